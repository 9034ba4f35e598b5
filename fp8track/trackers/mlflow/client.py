"""An ``MlflowClient`` whose calls are retried while the store is busy or unreachable
(:class:`RetryingClient`), and the one test of what counts as transient
(:func:`transient_mlflow_error`, also used by the tracker's own retries)."""

from __future__ import annotations

from typing import Any

from fp8track.trackers.retry import Backoff, call_with_backoff

CLIENT_BACKOFF = Backoff(for_s=120.0, initial_s=0.05, max_s=2.0)
"""The :class:`RetryingClient`'s default: short waits (a SQLite lock is released in milliseconds)
for up to two minutes."""


def transient_mlflow_error(exc: BaseException) -> bool:
    """A request that did not reach the server or that the server could not serve now (connection
    and time-out errors, MLflow's "API request ... failed", HTTP 429/502/503/504, a SQLite store
    locked by another process's write): a retry may cure it. Anything else (a bad value, no such
    run, a server error) is not transient."""
    if isinstance(exc, (ConnectionError, TimeoutError, OSError)) or "database is locked" in str(exc):
        return True
    try:
        from mlflow.exceptions import MlflowException
    except ImportError:
        return False
    if not isinstance(exc, MlflowException):
        return False
    return (
        str(exc).startswith("API request to")
        or exc.error_code in ("TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED")
        or exc.get_http_status_code() in (429, 502, 503, 504)
    )


class RetryingClient:
    """An ``MlflowClient`` whose calls are retried on :func:`transient_mlflow_error` as ``retry``
    says (:data:`CLIENT_BACKOFF` by default; :func:`fp8track.trackers.retry.call_with_backoff`), then
    the error is raised. For callers outside a tracker's queue (the sweep executor), where several
    processes write one SQLite store (MLflow waits 20 s for SQLite's lock, ``PRAGMA busy_timeout``,
    then raises "database is locked"). A failed write is rolled back by the store, so a retry cannot
    write twice."""

    def __init__(self, client: Any, retry: Backoff = CLIENT_BACKOFF) -> None:
        self._client, self._retry = client, retry
        self.retries = 0  # calls repeated after a transient error, over the client's life

    def _count(self, exc: BaseException) -> None:
        self.retries += 1

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            return call_with_backoff(
                lambda: attr(*args, **kwargs), transient=transient_mlflow_error, backoff=self._retry,
                on_retry=self._count,
            )  # fmt: skip

        return call
