"""A real ``mlflow server`` on 127.0.0.1 for tests: started in its own process group, stopped
(or killed mid-run) by that pid."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """``mlflow server`` over a SQLite store in ``root``; :meth:`start` waits until ``/health`` says OK."""

    def __init__(self, root: Path, port: int) -> None:
        self.root, self.port = root, port
        self.uri = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 120.0) -> MlflowServer:
        log = open(self.root / f"server-{time.time_ns()}.log", "wb")  # noqa: SIM115 (the child keeps it)
        exe = Path(sys.executable).with_name("mlflow")
        self.proc = subprocess.Popen(
            [
                str(exe), "server",
                "--backend-store-uri", f"sqlite:///{self.root}/server.db",
                "--artifacts-destination", str(self.root / "artifacts"),
                "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
            ],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            # No job runner: MLflow 3's server otherwise starts seven Huey consumer processes for
            # its GenAI jobs and periodic tasks, each importing MLflow (about 28 s of CPU per server
            # here); fp8track logs runs, metrics and artifacts, which the server serves without them.
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.read().strip() == b"OK":
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"mlflow server did not become healthy within {timeout_s} s")
            time.sleep(0.3)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop the server's process group with ``sig`` (SIGKILL: an abrupt crash)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=15)


@contextmanager
def mlflow_server(root: Path, port: int):
    server = MlflowServer(root, port).start()
    try:
        yield server.uri
    finally:
        server.stop()
