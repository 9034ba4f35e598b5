"""How a failing call is retried: one policy object (:class:`Backoff`) and the one back-off loop
(:func:`call_with_backoff`), used by every queued tracker's worker and by
:class:`fp8track.trackers.mlflow.RetryingClient`."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fp8track.errors import check_float


@dataclass(frozen=True)
class Backoff:
    """How a call that fails with a transient error is retried (:func:`call_with_backoff`): the
    waits start at ``initial_s`` seconds and double up to ``max_s``, for up to ``for_s`` seconds from
    the first failure (0: no retry).

    Raises:
        ConfigError: a negative ``for_s``, a non-positive ``initial_s``, ``max_s < initial_s``.
    """

    for_s: float = 0.0
    initial_s: float = 0.5
    max_s: float = 30.0

    def __post_init__(self) -> None:
        check_float("retry for_s", self.for_s, 0.0)
        check_float("retry initial_s", self.initial_s, 0.0, strict=True)
        check_float("retry max_s", self.max_s, self.initial_s)

    def describe(self) -> str:
        """The policy in words, for a notice."""
        return f"with back-off from {self.initial_s:g} s to {self.max_s:g} s for up to {self.for_s:g} s"


def call_with_backoff(
    call: Callable[[], Any],
    *,
    transient: Callable[[BaseException], bool],
    backoff: Backoff,
    wait: Callable[[float], Any] = time.sleep,
    stopped: Callable[[], bool] | None = None,
    on_retry: Callable[[BaseException], None] | None = None,
) -> Any:
    """``call()``, called again after an exception that ``transient`` accepts, as ``backoff``
    says. Then, or for any other exception, or once ``stopped()``, the exception is raised.
    ``wait(seconds)`` sleeps (an ``Event.wait`` lets a stop cut it short); ``on_retry(exc)`` runs
    before each wait."""
    delay, deadline = backoff.initial_s, None
    while True:
        try:
            return call()
        except Exception as exc:
            now = time.monotonic()
            deadline = now + backoff.for_s if deadline is None else deadline
            if (not backoff.for_s or now >= deadline or (stopped is not None and stopped())
                    or not transient(exc)):
                raise
            if on_retry is not None:
                on_retry(exc)
            wait(min(delay, max(deadline - now, 0.0)))
            delay = min(2 * delay, backoff.max_s)


NO_RETRY = Backoff()
"""Fail at once (``for_s=0``): a queued tracker's default."""

__all__ = ["Backoff", "NO_RETRY", "call_with_backoff"]
