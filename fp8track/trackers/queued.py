"""A tracker that delivers from one background thread, retrying a batch with back-off while the
destination is down (:class:`QueuedTracker`, the base of the W&B, MLflow and logger trackers)."""

from __future__ import annotations

import queue
import threading
import time
import warnings
from abc import abstractmethod

from fp8track.errors import ConfigError, check_float, check_int
from fp8track.monitoring.records import StepBatch
from fp8track.trackers.base import Tracker
from fp8track.trackers.retry import NO_RETRY, Backoff, call_with_backoff


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
        finish_timeout_s: the longest :meth:`finish` waits for the worker to drain the queue.
        stall_timeout_s: :meth:`finish` gives up sooner when no batch was handled for this long (a
            dead server: a client's own HTTP retries can hold one request for minutes). Either way
            the batches left are recorded as missed; the run directory holds them all.
        retry: how one batch is retried (:class:`Backoff`; the default ``for_s=0`` fails at once).
    """

    def __init__(
        self,
        *,
        background: bool = True,
        max_queue: int = 10_000,
        finish_timeout_s: float = 600.0,
        stall_timeout_s: float = 60.0,
        retry: Backoff = NO_RETRY,
    ) -> None:
        check_int("max_queue", max_queue, 1)
        check_float("finish_timeout_s", finish_timeout_s, 0.0, strict=True)
        check_float("stall_timeout_s", stall_timeout_s, 0.0, strict=True)
        if not isinstance(retry, Backoff):
            raise ConfigError(f"retry must be a fp8track.trackers.retry.Backoff, got {retry!r}")
        self.background = bool(background)
        self.finish_timeout_s = float(finish_timeout_s)
        self.stall_timeout_s = float(stall_timeout_s)
        self._handled_at = time.monotonic()  # when the worker last finished a batch
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
                self._handled_at = time.monotonic()
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

    FINISH_NOTICE_S = 5.0
    """Seconds :meth:`finish` waits quietly before it says it is waiting, and for what."""

    def _drain_for_finish(self) -> bool:
        """Wait for the worker to empty the queue: ``False`` once :attr:`finish_timeout_s` passed,
        or :attr:`stall_timeout_s` passed with no batch handled. Says at once (after
        :data:`FINISH_NOTICE_S`) that it is waiting, so a closing program never hangs unexplained."""
        start = time.monotonic()
        said = False
        while not self.flush(min(1.0, self.finish_timeout_s)):
            now = time.monotonic()
            if not said and now - start >= self.FINISH_NOTICE_S:
                said = True
                warnings.warn(
                    f"fp8track: tracker {self.name!r} still has {self._queue.unfinished_tasks} batch(es) "
                    f"to deliver; waiting up to {self.finish_timeout_s:g} s, or {self.stall_timeout_s:g} s "
                    "without progress. Everything is in the run directory; what is not delivered is "
                    "listed there and `fp8track sync <run dir>` sends it later.",
                    RuntimeWarning,
                    stacklevel=4,
                )
            stalled = now - max(self._handled_at, start) >= self.stall_timeout_s
            if stalled or now - start >= self.finish_timeout_s:
                return False
        return True

    def finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        if self.background and self._thread is not None:
            drained = self._drain_for_finish()
            if not drained:
                # The worker is stuck (e.g. a dead server): report the batch it holds and whatever is
                # still queued as missed, and leave it behind (it is a daemon thread; _stop ends its
                # retries).
                self._stop.set()
                timeout = TimeoutError(
                    f"not delivered within {self.finish_timeout_s:g} s "
                    f"(or {self.stall_timeout_s:g} s without progress) at finish"
                )
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
