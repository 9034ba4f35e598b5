"""One writer per run directory: a second process appending to the same directory would record
every step twice (the records are append-only and keyed by step, so nothing downstream could tell
the copies apart).

The writer holds an exclusive ``flock`` on ``<run_dir>/.writer.lock`` for its lifetime and writes
its pid, host and start time into it, so a refusal can say who holds the directory. The kernel
drops the lock when the process dies, so a crashed run leaves no stale lock and a resumed run
takes over. Where ``fcntl`` does not exist (Windows) there is no check.
"""

from __future__ import annotations

import json
import os
import socket
import time
import warnings
from pathlib import Path
from typing import IO

from fp8track.errors import ConfigError

LOCK_FILE = ".writer.lock"


def acquire(run_dir: Path) -> IO[str] | None:
    """Lock ``run_dir`` for this writer; returns the open lock file (keep it until :func:`release`),
    or ``None`` when the lock cannot be taken but the holder is an earlier writer of this same
    process (an abandoned monitor, a notebook cell run again: warned about, not refused).

    Raises:
        ConfigError: another live process writes this run directory (naming its pid and host).
    """
    try:
        import fcntl
    except ImportError:  # no flock on this platform: no check
        return None
    f = open(run_dir / LOCK_FILE, "a+", encoding="utf-8")  # noqa: SIM115 (held until release)
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = _holder(f.read())
        f.close()
        same_process = holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname()
        who = f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}"
        if not same_process:
            raise ConfigError(
                f"run directory {str(run_dir)!r} is being written by another process ({who}); two "
                "writers would record every step twice: give each run its own log_dir or run id, or "
                "make one process the writer (is_writer=False on the others)"
            ) from None
        warnings.warn(
            f"fp8track: run directory {run_dir} is still open in an earlier monitor of this process; "
            "close() it first, or its steps and this one's are both recorded",
            RuntimeWarning,
            stacklevel=4,
        )
        return None
    f.seek(0)
    f.truncate()
    f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}))
    f.flush()
    return f


def release(lock: IO[str] | None) -> None:
    """Drop the lock taken by :func:`acquire` (closing the file releases the ``flock``)."""
    if lock is not None and not lock.closed:
        lock.close()


def _holder(text: str) -> dict[str, object]:
    try:
        data = json.loads(text)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


__all__ = ["LOCK_FILE", "acquire", "release"]
