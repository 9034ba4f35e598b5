"""Environment for Python programs the tests start (worker scripts, sweep programs): the test kit
importable as ``helpers`` there too, without a ``sys.path`` edit in the program."""

from __future__ import annotations

import os
import shutil
import subprocess
import warnings
from pathlib import Path
from typing import Any

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


GLOO_THREAD_ABORT = "terminate called without an active exception"
"""What libstdc++ prints when a process ends with one of gloo's threads still joinable: seen now
and then on a loaded 2-core machine, never with a Python traceback or a wrong number."""


def run_gloo_program(cmd: list[str], out: Path, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, capture_output=True, text=True, **kwargs)``, run once more (with a
    warning in the test report, and ``out``, the folder it writes, emptied if it exists) when it
    failed only by :data:`GLOO_THREAD_ABORT`; any other failure, or the abort twice, is returned
    as it is for the test to fail on."""
    proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    before_abort, aborted, _ = proc.stderr.partition(GLOO_THREAD_ABORT)
    if proc.returncode != 0 and aborted and "Traceback" not in before_abort:
        warnings.warn(f"gloo aborted a worker ({GLOO_THREAD_ABORT!r}); ran it once more", stacklevel=2)
        for entry in out.iterdir() if out.exists() else ():
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    return proc
