"""A one-line live display of a running sweep: trials done, best so far, time left (rich, on stderr)."""

from __future__ import annotations

import math
import time
from typing import Any


class SweepProgress:
    """``trials 3/6 | best gap +0.0123 (trial 2) | 1m40s left`` while the sweep runs.

    The best gap is the smallest trial-minus-control gap seen (signed so + is worse than BF16, in
    the metric's units, as ``gap_vs_bf16``), not a metric value. Time left is the mean wall time
    of the trials this process finished times the trials still to run (unknown until one
    finished). ``enabled=False`` makes every call a no-op.
    """

    def __init__(self, total: int, *, enabled: bool = True, done: int = 0) -> None:
        self.total, self.done = total, done
        self.best: tuple[float, int] | None = None
        self._durations: list[float] = []
        self._live: Any = None
        self._progress: Any = None
        self._task: Any = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self._progress = Progress(
                TextColumn("[bold]sweep[/bold]"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"), console=Console(stderr=True), transient=False,
            )
            self._task = self._progress.add_task("sweep", total=total, completed=done, status="starting")
            self._progress.start()

    def status(self, text: str) -> None:
        """Show what is happening now (control, probe, trial n)."""
        if self._progress is not None:
            self._progress.update(self._task, status=f"{text} | {self._summary()}")

    def trial_finished(self, number: int, gap: float, seconds: float, done: int) -> None:
        """Trial ``number`` ended with ``gap`` to its control (NaN: none, e.g. it failed)."""
        self.done = done
        self._durations.append(seconds)
        if math.isfinite(gap) and (self.best is None or gap < self.best[0]):
            self.best = (gap, number)
        if self._progress is not None:
            self._progress.update(self._task, completed=min(done, self.total), status=self._summary())

    def time_left_s(self) -> float | None:
        if not self._durations:
            return None
        return max(self.total - self.done, 0) * sum(self._durations) / len(self._durations)

    def _summary(self) -> str:
        best = f"best gap {self.best[0]:+.4f} (trial {self.best[1]})" if self.best else "best gap -"
        left = self.time_left_s()
        eta = "time left ?" if left is None else f"{int(left // 60)}m{int(left % 60):02d}s left"
        return f"{best} | {eta}"

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def monotonic() -> float:
    return time.perf_counter()
