"""The failure-tolerant fan-out (:class:`TrackerFanout`) and the missed-step files it keeps.

The fan-out never lets a tracker stop training: a tracker that raises (or whose background worker
fails later) is warned about once, and each step it missed is appended to
``<run_dir>/sync/<tracker.name>.missed.jsonl`` so ``fp8track sync`` can replay it
(:func:`fp8track.trackers.replay.sync_run`).
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from fp8track.errors import ConfigError
from fp8track.monitoring.records import RunMeta, StepBatch, redact
from fp8track.trackers.base import ScalarsNotWritten, TablesNotWritten, Tracker

SYNC_DIR = "sync"
"""Sub-directory of a run directory holding one ``<tracker>.missed.jsonl`` file per tracker."""


def missed_path(run_dir: str | Path, tracker_name: str) -> Path:
    """``<run_dir>/sync/<tracker_name>.missed.jsonl``."""
    return Path(run_dir) / SYNC_DIR / f"{tracker_name}.missed.jsonl"


def read_missed(run_dir: str | Path, tracker_name: str) -> list[dict[str, Any]]:
    """The entries of a tracker's missed-steps file (``[]`` when there is none)."""
    path = missed_path(run_dir, tracker_name)
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # torn last line
    return out


class TrackerFanout:
    """Sends each step to every tracker; a failing tracker never stops training.

    On the first failure or retry notice of a tracker it warns once (``RuntimeWarning``); every
    failure appends ``{"step", "what", "error", "time"}`` to ``<run_dir>/sync/<name>.missed.jsonl``
    (``step`` is null for a failed ``start``/``finish``; ``what`` is ``"tables"`` when only the step's table
    rows were lost, see :class:`TablesNotWritten`, ``"scalars"`` when only its scalars were, see
    :class:`ScalarsNotWritten`). Owned by one monitor instance; nothing global.

    Args:
        trackers: :class:`Tracker` instances with distinct ``name`` s.
        run_dir: the run directory the records were written to.

    Raises:
        ConfigError: an element is not a Tracker, or two trackers share a name.
    """

    def __init__(self, trackers: Sequence[Tracker], run_dir: str | Path) -> None:
        trackers = list(trackers)
        for t in trackers:
            if not isinstance(t, Tracker):
                raise ConfigError(f"TrackerFanout expects Tracker instances, got {type(t).__name__}: {t!r}")
        names = [t.name for t in trackers]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(
                f"two trackers share the name(s) {dupes}; their missed-step files would collide. "
                "Pass name=... to the tracker constructors to tell them apart"
            )
        self.trackers = trackers
        self.run_dir = Path(run_dir)
        self._warned: set[str] = set()
        self.failures: dict[str, int] = {t.name: 0 for t in trackers}
        self.notices: dict[str, int] = {t.name: 0 for t in trackers}
        self._skip_through: int | None = None

    coalesces = True  # takes StepBatch.earlier; splits per tracker that does not

    def _fail(self, tracker: Tracker, step: int | None, what: str, exc: BaseException) -> None:
        self.failures[tracker.name] = self.failures.get(tracker.name, 0) + 1
        path = missed_path(self.run_dir, tracker.name)
        if isinstance(exc, TablesNotWritten):
            what = "tables"
        elif isinstance(exc, ScalarsNotWritten):
            what = "scalars"
        entry = {
            "step": step,
            "what": what,
            "error": redact(f"{type(exc).__name__}: {exc}")[:2000],
            "time": time.time(),
        }
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(entry) + "\n")
        except OSError as os_exc:  # even the local record failed: say so, still never raise
            warnings.warn(
                f"fp8track: could not record a missed step in {path}: {os_exc}", RuntimeWarning, stacklevel=3
            )
        if tracker.name not in self._warned:
            self._warned.add(tracker.name)
            warnings.warn(
                f"fp8track: tracker {tracker.name!r} failed during {what} (step {step}): {entry['error']}. "
                f"Training continues; missed steps are listed in {path} and can be replayed with "
                f"`fp8track sync {self.run_dir}`. Further failures of this tracker are recorded silently.",
                RuntimeWarning,
                stacklevel=3,
            )

    def _collect(self, tracker: Tracker, what: str) -> None:
        try:
            failures = tracker.take_failures()
            notices = tracker.take_notices()
        except Exception as exc:
            failures, notices = [(None, exc)], []
        for notice in notices:
            self.notices[tracker.name] = self.notices.get(tracker.name, 0) + 1
            if tracker.name not in self._warned:
                self._warned.add(tracker.name)
                warnings.warn(
                    f"fp8track: tracker {tracker.name!r}: {redact(notice)}. Training continues; "
                    "everything is in the "
                    f"run directory {self.run_dir}. Further problems of this tracker are recorded silently.",
                    RuntimeWarning,
                    stacklevel=3,
                )
        for step, exc in failures:
            self._fail(tracker, step, what, exc)

    def start(self, meta: RunMeta, recorded_before_resume: int | None = None) -> None:
        """Start every tracker. ``recorded_before_resume``: the run resumes from a checkpoint and
        the process that died had recorded steps up to this one; trackers with ``monotonic_steps``
        get no step up to it again (they may hold it already; MLflow instead checks its run's history),
        so their step axis only increases. The steps' records stay complete in the run directory."""
        self._skip_through = recorded_before_resume
        for t in self.trackers:
            try:
                t.start(meta)
            except Exception as exc:
                self._fail(t, None, "start", exc)

    def log(self, batch: StepBatch) -> None:
        skip = self._skip_through
        for t in self.trackers:
            parts = [batch] if t.coalesces else batch.split()
            for part in parts:
                if skip is not None and t.monotonic_steps:
                    if part.step <= skip:
                        continue
                    part = replace(part, earlier=[(s, m) for s, m in part.earlier if s > skip])
                try:
                    t.log(part)
                except Exception as exc:
                    for step in part.steps:
                        self._fail(t, step, "log", exc)
            self._collect(t, "log")

    def finish(self) -> None:
        for t in self.trackers:
            try:
                t.finish()
            except Exception as exc:
                self._fail(t, None, "finish", exc)
            self._collect(t, "log")
