"""A tracking URI with a password (``http://user:pw@host``) against a real ``mlflow server`` on
127.0.0.1 (started here, stopped by its pid): the password reaches no ConfigError, no printed line
(MLflow's own "View run ... at <URI>" included) and no traceback; ``fp8track sync`` to a server
that does not answer ends in one line, soon."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch

import fp8track
from fp8track.monitoring.records import MetricsRecord, RunMeta, RunWriter, StepBatch

pytestmark = pytest.mark.slow

mlflow = pytest.importorskip("mlflow")

from helpers.servers import free_port, mlflow_server  # noqa: E402

PASSWORD = "pw-7f3a9c"


def with_password(uri: str) -> str:
    return uri.replace("http://", f"http://alice:{PASSWORD}@")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with mlflow_server(tmp_path_factory.mktemp("server"), free_port()) as uri:
        yield uri


def cli(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fp8track.cli", *argv], capture_output=True, text=True, timeout=600, cwd=cwd,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip


def small_run(tmp_path: Path) -> Path:
    """A run directory of 4 steps written by the real writer."""
    writer = RunWriter(tmp_path / "run", RunMeta(run_id="cred-run", name="creds"))
    for step in range(4):
        writer.write_metrics(MetricsRecord(step, {"fp8/loss": 2.0 - step / 10}))
    writer.close()
    return writer.run_dir


def test_baseline_on_a_server_with_a_password_names_no_password(server, tmp_path):
    uri = with_password(server)
    with pytest.raises(fp8track.ConfigError) as info:
        fp8track.Monitor(torch.nn.Linear(4, 4), log_dir=tmp_path, baseline="mlflow:0123456789abcdef",
                         tracking_uri=uri)
    text = "".join(traceback.format_exception(info.value))  # what a user's terminal shows
    assert PASSWORD not in text
    assert "0123456789abcdef" in str(info.value) and "http://***@127.0.0.1" in str(info.value)


def test_diagnose_with_a_password_in_tracking_uri_is_one_line_without_it(server, tmp_path):
    run_dir = small_run(tmp_path)
    proc = cli("diagnose", str(run_dir), "--baseline", "mlflow:0123456789abcdef", "--tracking-uri",
               with_password(server), "--out", "diag", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert "http://***@127.0.0.1" in line and PASSWORD not in proc.stderr
    assert not (tmp_path / "diag").exists()


def test_sync_to_a_server_with_a_password_prints_mlflow_view_line_redacted(server, tmp_path):
    run_dir = small_run(tmp_path)
    proc = cli("sync", str(run_dir), "--mlflow-uri", with_password(server), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "View run" in proc.stdout and "http://***@127.0.0.1" in proc.stdout  # MLflow's own line
    assert PASSWORD not in proc.stdout + proc.stderr
    client = mlflow.MlflowClient(server)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "fp8/loss")] == [0, 1, 2, 3]


def test_tracker_finishing_its_own_run_prints_the_view_line_redacted(server, tmp_path, capsys):
    from fp8track.trackers.mlflow import MLflowTracker

    tracker = MLflowTracker(tracking_uri=with_password(server), background=False)
    tracker.start(RunMeta(name="own"))
    tracker.log(StepBatch(step=0, metrics={"fp8/loss": 1.0}))
    tracker.finish()
    out = capsys.readouterr()
    assert "View run" in out.out and "http://***@127.0.0.1" in out.out
    assert PASSWORD not in out.out + out.err


def test_sync_to_a_server_that_does_not_answer_is_one_line_soon(tmp_path):
    run_dir = small_run(tmp_path)
    dead = with_password(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    t0 = time.monotonic()
    proc = cli("sync", str(run_dir), "--mlflow-uri", dead, cwd=tmp_path)
    seconds = time.monotonic() - t0
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    assert (
        line.startswith("fp8track sync: error: --mlflow-uri http://***@127.0.0.1")
        and "cannot be used" in line
    )
    assert PASSWORD not in proc.stderr
    assert seconds < 90, seconds  # MLflow's own retries took 252 s before
