"""Environment for Python programs the tests start (worker scripts, sweep programs): the test kit
importable as ``helpers`` there too, without a ``sys.path`` edit in the program."""

from __future__ import annotations

import os
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
"""The ``tests/`` folder: where ``helpers`` lives."""


def python_env(**extra: str) -> dict[str, str]:
    """``os.environ`` plus ``extra``, with :data:`TESTS` first on ``PYTHONPATH``."""
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}
