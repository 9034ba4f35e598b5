"""The README's main job, end to end: `fp8track demo` on a short budget."""

import json
import subprocess
import sys

import pytest
from mlflow import MlflowClient

from fp8track.monitoring.records import RunReader


@pytest.mark.slow
def test_demo_writes_both_runs_to_mlflow_and_compares_them(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "fp8track.cli", "demo", "--out", str(out), "--steps", "30", "--every-n-steps", "5", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout[: proc.stdout.index("\n}\n") + 2])
    control, fp8 = summary["runs"]
    assert (control["recipe"], fp8["recipe"]) == ("bf16", "delayed:hybrid:h16:max")
    assert f"mlflow ui --backend-store-uri sqlite:///{out / 'mlflow.db'}" in proc.stdout

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    for run in (control, fp8):
        reader = RunReader(run["run_dir"])
        assert sorted(reader.series("fp8/loss")) == list(range(30))
        assert {r.step for r in reader.tensor_stats()} == {0, 5, 10, 15, 20, 25}
        mlrun = client.get_run(run["mlflow_run_id"])
        history = client.get_metric_history(run["mlflow_run_id"], "fp8/worst/mse")
        assert sorted(m.step for m in history) == [0, 5, 10, 15, 20, 25]
        assert mlrun.data.tags["fp8track.run_id"] == reader.meta()["run_id"]
        artifacts = {a.path for a in client.list_artifacts(run["mlflow_run_id"])}
        assert {"fp8_heatmap.png", "fp8_tensor_stats.json"} <= artifacts, artifacts
    # the control is judged in shadow mode, the FP8 run with its own scales, against the control
    assert {r.variant for r in RunReader(control["run_dir"]).tensor_stats()} == {"shadow"}
    assert {r.variant for r in RunReader(fp8["run_dir"]).tensor_stats()} == {"actual"}
    gap = client.get_metric_history(fp8["mlflow_run_id"], "fp8/loss_gap_vs_baseline")
    # every sampled step, plus the last step (flushed when the run closes)
    assert sorted(m.step for m in gap) == [0, 5, 10, 15, 20, 25, 29]
    fp8_loss = RunReader(fp8["run_dir"]).series("fp8/loss")
    control_loss = RunReader(control["run_dir"]).series("fp8/loss")
    last = max(m.step for m in gap)
    assert next(m.value for m in gap if m.step == last) == pytest.approx(fp8_loss[last] - control_loss[last], rel=1e-6)
