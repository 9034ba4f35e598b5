"""Run one trial's program as a subprocess attached to its MLflow child run, and watch its metric.

The program is started in a new session (its own process group, so ``torchrun`` and its ranks
stop together) with ``MLFLOW_RUN_ID`` / ``MLFLOW_TRACKING_URI`` naming the child run. While it runs,
the metric's history in that run is read every ``poll_s`` seconds; each new value (in step order:
its position is the hyperband iteration W&B counts) goes to ``on_value``, and ``True`` stops the
program: SIGTERM to the group, SIGKILL after ``grace_s`` seconds, as ``wandb agent`` stops a run
(``Agent._command_stop``: terminate, then kill after its ``KILL_DELAY``). A program still running
after ``timeout_s`` seconds is stopped the same way (``timed_out``).

The program's own process group keeps it out of the terminal's Ctrl-C and out of signals sent to
the sweep alone, so the sweep stops it itself: whatever ends the watch loop (an exception, the
``KeyboardInterrupt`` the sweep's SIGINT/SIGTERM handler raises) stops the group before it
propagates; no trial outlives its sweep.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class ProgramResult:
    """What one program run left.

    Attributes:
        returncode: the exit status (negative: killed by that signal).
        values: the metric's values in step order, as read from the run.
        pruned: ``on_value`` asked to stop it.
        seconds: wall time.
        log: the program's stdout and stderr.
        pid: its process id (the process group's id too).
        timed_out: it ran past ``timeout_s`` and was stopped.
    """

    returncode: int
    values: list[float] = field(default_factory=list)
    pruned: bool = False
    seconds: float = 0.0
    log: Path | None = None
    pid: int = 0
    timed_out: bool = False

    def tail(self, n: int = 20) -> str:
        """The last ``n`` lines of the log."""
        if self.log is None or not self.log.is_file():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def metric_values(client: Any, run_id: str, metric: str) -> list[float]:
    """The metric's history in the run, ordered by step then time (one value per logged step)."""
    history = sorted(client.get_metric_history(run_id, metric), key=lambda m: (m.step, m.timestamp))
    return [float(m.value) for m in history]


def stop_group(proc: subprocess.Popen[Any], grace_s: float) -> None:
    """SIGTERM the process group of ``proc``, SIGKILL it after ``grace_s`` seconds, reap it."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_program(
    argv: Sequence[str],
    env: Mapping[str, str],
    client: Any,
    run_id: str,
    metric: str,
    on_value: Callable[[int, float], bool],
    *,
    log: Path,
    cwd: Path | None = None,
    poll_s: float = 0.5,
    grace_s: float = 10.0,
    timeout_s: float | None = None,
) -> ProgramResult:
    """Run ``argv`` until it exits, ``on_value(index, value)`` returns True, or ``timeout_s``
    seconds passed (module docstring)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(list(argv), env=dict(env), cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    seen: list[float] = []
    pruned = timed_out = False
    try:
        while True:
            rc = proc.poll()
            if rc is None and timeout_s is not None and time.perf_counter() - t0 > timeout_s:
                timed_out = True
                break
            values = metric_values(client, run_id, metric)
            for i in range(len(seen), len(values)):
                seen.append(values[i])
                if on_value(i, values[i]):
                    pruned = True
                    break
            if pruned or rc is not None:
                break
            time.sleep(poll_s)
    finally:
        if proc.poll() is None:
            stop_group(proc, grace_s)
    return ProgramResult(int(proc.returncode), seen, pruned, time.perf_counter() - t0, log, proc.pid,
                         timed_out)


__all__ = ["ProgramResult", "metric_values", "stop_group", "run_program"]
