"""The documentation site (mkdocs.yml over docs/) builds with ``--strict``, and strict really fails
on a dead link; the README stays short and neither it nor docs/ carries issue numbers or dates."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        capture_output=True, text=True, timeout=300, env=env,
    )


def test_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (the docs extra: pip install -e '.[docs]')")
    pytest.importorskip("mkdocstrings", reason="mkdocstrings is not installed (the docs extra)")
    proc = _mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode == 0, proc.stderr[-4000:]
    # every page of the navigation rendered, the reference from the docstrings included
    reference = (tmp_path / "site" / "reference" / "diagnosis" / "index.html").read_text()
    assert "Diagnose an FP8 run against its BF16 control" in reference  # fp8track.diagnose's docstring
    for page in ("getting-started", "guides/lightning", "guides/plain-loop", "guides/hf-trainer",
                 "guides/fabric", "diagnosis", "sweep", "moe", "trackers", "performance", "reliability"):
        assert (tmp_path / "site" / page / "index.html").is_file(), page


def test_strict_build_fails_on_a_dead_link(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (the docs extra: pip install -e '.[docs]')")
    pytest.importorskip("mkdocstrings", reason="mkdocstrings is not installed (the docs extra)")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    page = tmp_path / "docs" / "limits.md"
    page.write_text(page.read_text() + "\nSee [the execution notes](parts/exec.md).\n")
    proc = _mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode != 0
    assert "parts/exec.md" in proc.stderr


def test_readme_is_short_and_docs_carry_no_issue_numbers_or_dates():
    assert len((ROOT / "README.md").read_text()) < 10_000
    pattern = re.compile(r"[Ii]ssue [0-9]+|20[0-9]{2}-[0-9]{2}-[0-9]{2}")
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "fp8track").rglob("*.py")]
    hits = [f"{f.relative_to(ROOT)}:{m.group()}" for f in files for m in pattern.finditer(f.read_text())]
    assert hits == []
