"""Build hook: the wheel carries the top-level ``integrations/`` folder as ``fp8track/integrations``
(package data), so ``fp8track integrations --copy DIR`` works from an installed package. Everything
else is declared in pyproject.toml."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithIntegrations(build_py):
    def run(self) -> None:
        super().run()
        src = Path(__file__).resolve().parent / "integrations"
        if src.is_dir():
            shutil.copytree(src, Path(self.build_lib) / "fp8track" / "integrations", dirs_exist_ok=True)


setup(cmdclass={"build_py": BuildPyWithIntegrations})
