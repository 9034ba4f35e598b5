"""Tracker interface, the background-delivery base class and the failure-tolerant fan-out.

A tracker is a *view* of the local run directory (docs/ARCHITECTURE.md): the monitor writes every
record there first, then hands one :class:`StepBatch` per logging step to a
:class:`TrackerFanout`. The fan-out never lets a tracker stop training: a tracker that raises (or
whose background worker fails later) is warned about once, and each step it missed is appended to
``<run_dir>/sync/<tracker.name>.missed.jsonl`` so ``fp8track sync`` can replay it
(:func:`fp8track.trackers.replay.replay`).
"""

from __future__ import annotations

import json
import math
import queue
import threading
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fp8track.errors import ConfigError, check_float, check_int
from fp8track.monitoring import naming
from fp8track.monitoring.records import EventRecord, RunMeta, StepBatch, TensorStatsRow, redact
from fp8track.trackers.retry import NO_RETRY, Backoff, call_with_backoff

SYNC_DIR = "sync"
"""Sub-directory of a run directory holding one ``<tracker>.missed.jsonl`` file per tracker."""

EVENT_TABLES: Mapping[str, str] = {
    "spike": naming.TABLE_SPIKE_EVENTS,
    "nonfinite": naming.TABLE_SPIKE_EVENTS,
    "divergence": naming.TABLE_SPIKE_EVENTS,
    "drift": naming.TABLE_DRIFT_EVENTS,
    "finding": naming.TABLE_FINDINGS,
}
"""Event kind -> tracker table. Other kinds (tracker failures, end markers) stay local only."""

EVENT_COLUMNS: tuple[str, ...] = ("step", "kind", "layer", "tensor", "severity", "title", "data")
"""Columns of every event table; ``data`` is the event's full payload as JSON text."""

TENSOR_KEY_COLUMNS: tuple[str, ...] = ("step", "layer", "tensor", "variant")
"""Leading columns of the long-format tensor statistics table; one column per statistic follows."""


@dataclass(frozen=True)
class StoredRun:
    """What a tracker's reader found of one run (plain data; the analysis builds its ``RunData``
    from it).

    Attributes:
        source: the reference it was read from (``mlflow:<id>``, a W&B run directory).
        metrics: scalar name -> ``{step: value}``.
        tensor_rows: per (step, layer, tensor, variant) statistics: the tracker's tensor table when
            it has one, else rebuilt from the per-layer scalars (:func:`rows_from_scalars`).
        meta: run metadata in the shape of ``meta.json`` (``run_id``, ``name``, ``recipe``,
            ``config``...).
    """

    source: str
    metrics: Mapping[str, Mapping[int, float]]
    tensor_rows: Sequence[TensorStatsRow] = ()
    meta: Mapping[str, Any] = field(default_factory=dict)


def rows_from_scalars(metrics: Mapping[str, Mapping[int, float]]) -> list[TensorStatsRow]:
    """Rebuild tensor-statistics rows from per-layer scalars ``fp8/<layer>/<tensor>/<stat>`` (what a
    tracker keeps when its tables are unavailable); variant ``"actual"``.

    Example:
        >>> rows_from_scalars({"fp8/fc1/activation/mse": {3: 0.5}, "fp8/fc1/activation/amax": {3: 2.0},
        ...                    "fp8/loss": {3: 1.0}})  # doctest: +NORMALIZE_WHITESPACE
        [TensorStatsRow(step=3, layer='fc1', tensor='activation', stats={'mse': 0.5, 'amax': 2.0},
                        variant='actual')]
    """
    from fp8track.numerics.formats import TENSOR_KINDS
    from fp8track.numerics.stats import STAT_NAMES

    cells: dict[tuple[int, str, str], dict[str, float]] = {}
    for name, series in metrics.items():
        parts = name.split("/")
        if (
            len(parts) < 4
            or parts[0] != naming.PREFIX
            or parts[-2] not in TENSOR_KINDS
            or parts[-1] not in STAT_NAMES
        ):
            continue
        layer = "/".join(parts[1:-2])
        for step, v in series.items():
            cells.setdefault((int(step), layer, parts[-2]), {})[parts[-1]] = float(v)
    return [TensorStatsRow(s, layer, t, stats) for (s, layer, t), stats in sorted(cells.items())]


class ScalarsNotWritten(Exception):
    """A step's table rows and events were kept by the tracker (they go out with a later step) but
    its scalars did not arrive. Recorded as ``what="scalars"``; replay then re-sends only the
    scalars of that step, so table rows are never sent twice."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.__cause__ = cause


class TablesNotWritten(Exception):
    """A step's scalars reached the tracker but its table rows/events did not (e.g. the final
    table write failed). Recorded as ``what="tables"``; replay then re-sends only the rows and
    events of that step, so scalar histories get no duplicate points."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.__cause__ = cause


def scalar_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The entries of ``metrics`` that are real numbers, as floats (bools, strings, None dropped)."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if isinstance(v, bool) or v is None:
            continue
        try:
            out[k] = float(v)
        except (TypeError, ValueError):
            continue
    return out


def event_row(event: EventRecord) -> list[Any]:
    """One row of an event table (columns :data:`EVENT_COLUMNS`)."""
    d = event.data
    severity = d.get("severity")
    return [
        int(event.step),
        event.kind,
        str(d.get("layer", "")),
        str(d.get("tensor", "")),
        float(severity) if isinstance(severity, (int, float)) and not isinstance(severity, bool) else None,
        redact(event_title(event)),
        redact(json.dumps(dict(d), default=str, sort_keys=True)),
    ]


def event_title(event: EventRecord) -> str:
    """The event's ``data["title"]``, else one built from its kind, layer, tensor, what it is
    (direction, status or reason) and step: ``"drift in fc1.activation (overflow_risk) at step 210"``."""
    d = event.data
    if d.get("title"):
        return str(d["title"])
    where = ".".join(str(d[k]) for k in ("layer", "tensor") if d.get(k))
    what = next((str(d[k]) for k in ("direction", "status", "reason") if d.get(k)), "")
    words = [event.kind.replace("_", " ")]
    if where:
        words.append(f"in {where}")
    if what:
        words.append(f"({what})")
    return " ".join([*words, f"at step {event.step}"])


def event_severity(event: EventRecord) -> float:
    """``data["severity"]`` as a float (higher is worse); ``-inf`` when absent or not a finite number."""
    s = event.data.get("severity")
    if isinstance(s, bool) or not isinstance(s, (int, float)) or math.isnan(s):
        return -math.inf
    return float(s)


def tensor_stat_columns(rows: Sequence[TensorStatsRow]) -> list[str]:
    """Statistic columns for a table started with ``rows``: fp8track's statistics first, in their
    fixed order, then any other names (e.g. from Transformer Engine) in order of appearance."""
    from fp8track.numerics.stats import STAT_NAMES

    seen: dict[str, None] = {}
    for r in rows:
        for k in r.stats:
            seen.setdefault(k, None)
    known = [s for s in STAT_NAMES if s in seen]
    return known + [k for k in seen if k not in STAT_NAMES]


class Tracker(ABC):
    """A destination for step batches (W&B, MLflow, ...).

    Subclasses implement :meth:`log`; :meth:`start` and :meth:`finish` are optional. ``log`` must
    not block the training thread for long (see :class:`QueuedTracker`). Errors may be raised
    directly, or reported later through :meth:`take_failures`; :class:`TrackerFanout` handles both.
    """

    name: str = "tracker"
    # True where a step sent twice would break the step axis (W&B's history, a Lightning logger): a
    # resumed run then skips the steps the process that died had recorded (see TrackerFanout.start).
    monotonic_steps: bool = False
    coalesces: bool = False
    """Whether :meth:`log` takes a batch's ``earlier`` steps (one call per flush); others get one
    batch per step (:meth:`StepBatch.split`)."""

    def start(self, meta: RunMeta) -> None:  # noqa: B027 (optional hook)
        """Record what the run is (recipe, BF16 layers, versions) as config/params/tags."""

    @abstractmethod
    def log(self, batch: StepBatch) -> None:
        """Deliver (or enqueue) one logging step."""

    def finish(self) -> None:  # noqa: B027 (optional hook)
        """Flush everything, write tables and figures, close what this tracker opened."""

    def take_failures(self) -> list[tuple[int | None, BaseException]]:
        """Failures found since the last call, as ``(step or None, exception)``; clears them."""
        return []

    def take_notices(self) -> list[str]:
        """Conditions worth one warning that lose nothing (e.g. "retrying"); clears them."""
        return []


class QueuedTracker(Tracker):
    """A tracker that delivers batches from one background thread.

    :meth:`log` only puts the batch on a bounded queue (microseconds), so the training thread is
    not blocked by network or database I/O. Subclasses implement :meth:`_deliver` (runs in the
    worker) and optionally :meth:`_close` (runs in :meth:`finish` after the queue is drained).
    A ``_deliver`` that fails with a *transient* error (:meth:`_transient`: the server is down or
    slow) is retried with exponential back-off as ``retry`` says (:class:`Backoff`: ``initial_s``
    doubling up to ``max_s``, for up to ``for_s`` per batch); batches logged meanwhile wait in the
    queue, in order, and go out once the destination is back, so an outage shorter than that
    loses nothing and needs no ``fp8track sync``. The first retry of an outage is reported once
    through :meth:`take_notices`. ``_deliver`` must therefore be idempotent for one batch (the
    MLflow adapter reuses the batch's timestamps, which MLflow's stores de-duplicate on).
    A batch that still fails is recorded with its step and surfaces through
    :meth:`take_failures`; the worker keeps going. When the queue is full, ``log`` raises
    :class:`queue.Full` instead of blocking: the fan-out records the step as missed (it is on
    disk; ``fp8track sync`` replays it).

    Args:
        background: deliver in a worker thread (default); ``False`` delivers inside :meth:`log`
            (no retries: the caller's thread must not sleep).
        max_queue: batches that may wait for the worker before :meth:`log` refuses more.
        finish_timeout_s: how long :meth:`finish` waits for the worker to drain the queue.
        retry: how one batch is retried (:class:`Backoff`; the default ``for_s=0`` fails at once).
    """

    def __init__(
        self,
        *,
        background: bool = True,
        max_queue: int = 10_000,
        finish_timeout_s: float = 600.0,
        retry: Backoff = NO_RETRY,
    ) -> None:
        check_int("max_queue", max_queue, 1)
        check_float("finish_timeout_s", finish_timeout_s, 0.0, strict=True)
        if not isinstance(retry, Backoff):
            raise ConfigError(f"retry must be a fp8track.trackers.retry.Backoff, got {retry!r}")
        self.background = bool(background)
        self.finish_timeout_s = float(finish_timeout_s)
        self.retry = retry
        self.retries = 0  # deliveries retried over the tracker's life
        self._notices: list[str] = []
        self._in_outage = False
        self._stop = threading.Event()
        self._queue: queue.Queue[StepBatch | None] = queue.Queue(maxsize=max_queue)
        self._failures: list[tuple[int | None, BaseException]] = []
        self._failures_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._inflight: StepBatch | None = None
        self._finished = False

    @abstractmethod
    def _deliver(self, batch: StepBatch) -> None:
        """Send one batch to the tracker (runs in the worker thread when ``background``)."""

    def _close(self) -> None:  # noqa: B027 (optional hook)
        """Final writes (tables, figures) after every batch was delivered."""

    def _record_failure(self, step: int | None, exc: BaseException) -> None:
        with self._failures_lock:
            self._failures.append((step, exc))

    def take_failures(self) -> list[tuple[int | None, BaseException]]:
        with self._failures_lock:
            out, self._failures = self._failures, []
        return out

    def _notice(self, message: str) -> None:
        with self._failures_lock:
            self._notices.append(message)

    def take_notices(self) -> list[str]:
        with self._failures_lock:
            out, self._notices = self._notices, []
        return out

    def _transient(self, exc: BaseException) -> bool:
        """Whether retrying may help: connection and time-out errors (subclasses add their own)."""
        return isinstance(exc, (ConnectionError, TimeoutError))

    def _deliver_with_retry(self, batch: StepBatch) -> None:
        def on_retry(exc: BaseException) -> None:
            if not self._in_outage:
                self._in_outage = True
                self._notice(
                    f"step {batch.step} not delivered ({type(exc).__name__}: {str(exc)[:300]}); retrying "
                    f"{self.retry.describe()} per step, later steps wait in the queue"
                )
            self.retries += 1

        call_with_backoff(
            lambda: self._deliver(batch), transient=self._transient, backoff=self.retry,
            wait=self._stop.wait, stopped=self._stop.is_set, on_retry=on_retry,
        )  # fmt: skip
        self._in_outage = False

    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            try:
                if batch is None:
                    return
                self._inflight = batch
                try:
                    self._deliver_with_retry(batch)
                except Exception as exc:  # a tracker error must never kill the process
                    if not self._stop.is_set():  # after a timed-out finish, finish recorded it
                        for step in batch.steps:
                            self._record_failure(step, exc)
                finally:
                    self._inflight = None
            finally:
                self._queue.task_done()

    def _ensure_worker(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name=f"fp8track-{self.name}", daemon=True)
            self._thread.start()

    def log(self, batch: StepBatch) -> None:
        if self._finished:
            raise RuntimeError(f"tracker {self.name!r} already finished")
        if not self.background:
            self._deliver(batch)
            return
        self._ensure_worker()
        self._queue.put_nowait(batch)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued batch was handled; ``False`` if ``timeout_s`` passed first."""
        if not self.background or self._thread is None:
            return True
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._queue.all_tasks_done.wait(remaining)
        return True

    def finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        if self.background and self._thread is not None:
            drained = self.flush(self.finish_timeout_s)
            if not drained:
                # The worker is stuck (e.g. a dead server): report the batch it holds and whatever is
                # still queued as missed, and leave it behind (it is a daemon thread; _stop ends its
                # retries).
                self._stop.set()
                timeout = TimeoutError(f"not delivered within {self.finish_timeout_s} s")
                inflight = self._inflight
                for step in inflight.steps if inflight is not None else []:
                    self._record_failure(step, timeout)
                while True:
                    try:
                        batch = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    for step in batch.steps if batch is not None else []:
                        self._record_failure(step, timeout)
                    self._queue.task_done()
                raise timeout
            else:
                self._queue.put(None)
                self._thread.join(timeout=self.finish_timeout_s)
        self._close()


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
