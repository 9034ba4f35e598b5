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


STATS_KERNEL_ENV = "FP8TRACK_STATS_KERNEL"
USER_STATS_KERNEL_ENV = "FP8TRACK_TESTS_USER_STATS_KERNEL"
"""What the user exported as ``$FP8TRACK_STATS_KERNEL`` ("" for nothing), recorded by the first
process of the run (xdist's controller) before it changes the variable; its workers inherit it."""


def choose_stats_kernels() -> str:
    """Processes the tests start run the eager statistics kernel unless the user exported a
    choice; returns the mode for the tests' own process (the user's choice, by default ``auto``)."""
    user = os.environ.setdefault(USER_STATS_KERNEL_ENV, os.environ.get(STATS_KERNEL_ENV, ""))
    os.environ[STATS_KERNEL_ENV] = user or "eager"
    return user or "auto"


def user_default_env() -> dict[str, str]:
    """``os.environ`` with the statistics kernel the user chose (by default none: ``auto``), for a
    test that runs a command exactly as a user would."""
    env = {k: v for k, v in os.environ.items() if k not in (STATS_KERNEL_ENV, USER_STATS_KERNEL_ENV)}
    user = os.environ.get(USER_STATS_KERNEL_ENV)
    return {**env, STATS_KERNEL_ENV: user} if user else env
