"""``fp8track.diagnose``: the diagnosis from run references, as a user calls it (run directories
written by the run writer, a control replayed into a real MLflow SQLite store), and
``import fp8track`` staying light."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import fp8track
from fp8track.analysis.synthetic_loss import plant_divergence

from helpers.synthetic_runs import PLANTED, N, layer_rows, synthetic_pair


def _mid_training_pair(tmp_path):
    """An FP8 run whose loss runs away from step 180, the planted layer broken from step 170."""
    return synthetic_pair(
        tmp_path,
        fp8_loss=lambda c, rng: plant_divergence(c * (1 + rng.normal(0, 0.002, N)), 180, 0.004),
        fp8_rows=lambda rng: layer_rows(rng, planted_from=170),
    )


def test_a_healthy_pair_of_run_directories_is_healthy(tmp_path):
    synthetic_pair(tmp_path)
    d = fp8track.diagnose(tmp_path / "fp8", str(tmp_path / "control"))
    assert d.kinds() == ["healthy"] and d.verdict.verdict == "healthy"
    assert d.top.severity == "info"
    assert d.fp8_source.endswith("fp8") and d.control_source.endswith("control")
    assert not (tmp_path / "diagnosis.json").exists()  # no out_dir: nothing written


def test_a_mid_training_gap_names_the_planted_layer_and_writes_the_report(tmp_path):
    _mid_training_pair(tmp_path)
    d = fp8track.diagnose(tmp_path / "fp8", tmp_path / "control", out_dir=tmp_path / "out")
    assert d.top.kind == "mid_training_gap" and d.top.severity in ("medium", "high")
    assert 180 <= d.top.steps[0] <= 230  # inside the planted rise
    assert d.top.layers[0] == PLANTED and d.layer_ranking[0].layer == PLANTED
    assert (d.verdict.verdict, d.verdict.cause, d.verdict.layers[0]) == ("fp8_problem", "mid_training_gap",
                                                                          PLANTED)
    written = json.loads((tmp_path / "out" / "diagnosis.json").read_text())
    assert [f["kind"] for f in written["findings"]] == d.kinds()
    assert written["data_problems"] == {"fp8": [], "control": []}
    assert (tmp_path / "out" / "report.html").stat().st_size > 10_000


def test_a_control_read_from_mlflow_gives_the_same_diagnosis(tmp_path, mlflow_store):
    from fp8track.trackers import sync_run
    from fp8track.trackers.mlflow import MLflowTracker

    _mid_training_pair(tmp_path)
    tracker = MLflowTracker(
        tracking_uri=mlflow_store.uri, experiment_name=mlflow_store.experiment(), background=False,
        heatmap=False,
    )
    assert sync_run(tmp_path / "control", tracker, only_missed=False) == N
    from_dir = fp8track.diagnose(tmp_path / "fp8", tmp_path / "control")
    from_mlflow = fp8track.diagnose(
        tmp_path / "fp8", f"mlflow:{tracker.run_id}", tracking_uri=mlflow_store.uri
    )
    assert from_mlflow.kinds() == from_dir.kinds()
    assert from_mlflow.verdict == from_dir.verdict  # the same verdict from a run dir and MLflow
    assert from_mlflow.top.layers[0] == PLANTED
    assert from_mlflow.loss.final_gap == pytest.approx(from_dir.loss.final_gap, rel=1e-6)


def test_runs_that_do_not_pair_and_bad_references_are_config_errors(tmp_path):
    synthetic_pair(tmp_path)
    with pytest.raises(fp8track.ConfigError, match="same run"):
        fp8track.diagnose(tmp_path / "fp8", tmp_path / "fp8", out_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before anything is written
    with pytest.raises(fp8track.ConfigError, match="does not exist"):
        fp8track.diagnose(tmp_path / "missing", tmp_path / "control")
    with pytest.raises(fp8track.ConfigError, match="no run id"):
        fp8track.diagnose("mlflow:", tmp_path / "control")


def test_import_fp8track_stays_light():
    """The package-level ``diagnose`` loads its modules on first use, not at ``import fp8track``."""
    heavy = ("fp8track.report", "fp8track.analysis", "matplotlib", "mlflow", "wandb", "lightning")
    code = f"import fp8track, sys; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    assert "diagnose" in fp8track.__all__ and "diagnose" in dir(fp8track)
