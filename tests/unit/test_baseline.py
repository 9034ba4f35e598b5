"""Baseline loading from real stores (RunWriter dir, MLflow on SQLite, W&B offline), step-aligned
gaps, and shared / FP8-only spike classification."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fp8track.analysis import synthetic_loss as sl
from fp8track.analysis.baseline import Baseline, classify_spike, load_baseline, loss_gap, spike_summary
from fp8track.analysis.spikes import SpikeConfig, SpikeEvent, detect_spikes
from fp8track.errors import ConfigError
from fp8track.monitoring.records import MetricsRecord, RunMeta, RunWriter


def control_curve(n: int = 600) -> dict[int, float]:
    """A control with one planted spike at step 300 (height 0.8, 3 steps up, decay 10)."""
    rng = np.random.default_rng(0)
    x = sl.healthy(sl.Curve(start=4.0, floor=3.0, sigma=0.005), n, rng)
    x = sl.plant_spike(x, 300, 0.8, rise=3, decay=10.0)
    return dict(enumerate(x.tolist()))


SMALL = SpikeConfig(window=64, warmup=32)


def test_local_run_dir(tmp_path):
    series = control_curve()
    w = RunWriter(tmp_path / "ctl", RunMeta(name="bf16"))
    for s, v in series.items():
        w.write_metrics(MetricsRecord(step=s, metrics={"train/loss": v, "lr": 1e-3}))
    w.close()
    b = load_baseline(str(tmp_path / "ctl"), spike_config=SMALL)
    assert b.key == "train/loss" and b.loss == pytest.approx(series)
    (spike,) = [e for e in b.spikes if e.kind == "spike"]
    assert spike.start_step == 300 and spike.peak_step == 302 and spike.status == "recovered"
    assert [e.to_dict() for e in b.spikes] == [e.to_dict() for e in detect_spikes(series, SMALL)]
    with pytest.raises(ConfigError, match="has no metric 'nll'; it has: lr, train/loss"):
        load_baseline(tmp_path / "ctl", key="nll")


def test_mlflow_sqlite_run(mlflow_store, monkeypatch):
    tracking = pytest.importorskip("mlflow.tracking")
    uri = mlflow_store.uri
    client = tracking.MlflowClient(tracking_uri=uri)  # no process-global tracking URI
    run = client.create_run(client.create_experiment(mlflow_store.experiment("ctl")))
    series = {s: v for s, v in control_curve().items() if s % 2 == 0}  # logged every 2 steps
    for s, v in series.items():
        client.log_metric(run.info.run_id, "train_loss", v, step=s)
    client.set_terminated(run.info.run_id)
    b = load_baseline(f"mlflow:{run.info.run_id}", tracking_uri=uri, spike_config=SMALL)
    assert b.key == "train_loss" and b.loss == pytest.approx(series)
    assert b.step_spacing == 2
    assert [e.start_step for e in b.spikes if e.kind == "spike"] == [300]
    # env var fallback; and errors
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert load_baseline(f"mlflow:{run.info.run_id}", spike_config=SMALL).loss == b.loss
    with pytest.raises(ConfigError, match="no such run"):
        load_baseline("mlflow:0123456789abcdef", tracking_uri=uri)
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    with pytest.raises(ConfigError, match="needs a tracking URI"):
        load_baseline(f"mlflow:{run.info.run_id}")


def test_wandb_offline_run(tmp_path):
    wandb = pytest.importorskip("wandb")
    series = control_curve(400)
    run = wandb.init(
        mode="offline", dir=str(tmp_path), project="fp8track-test", settings=wandb.Settings(silent=True)
    )
    for s, v in series.items():
        row = {"loss": v, "trainer/global_step": 10 * s}  # Lightning logs its own step key
        if s == 399:
            row["loss"] = math.nan
        run.log(row)
    run.finish()
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    for ref in (run_dir, next(run_dir.glob("run-*.wandb")), tmp_path / "wandb"):
        b = load_baseline(str(ref), spike_config=SMALL)
        assert b.key == "loss"
        assert sorted(b.loss) == [10 * s for s in series]
        assert b.loss[10 * 300] == pytest.approx(series[300])
        assert math.isnan(b.loss[3990])
    assert [e.start_step for e in b.spikes if e.kind == "spike"] == [3000]
    assert [e.start_step for e in b.spikes if e.kind == "nonfinite"] == [3990]


def test_bad_refs_name_the_forms(tmp_path):
    with pytest.raises(ConfigError, match="does not exist; give one of: a local fp8track run directory"):
        load_baseline(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="is not a run; give one of: .*'mlflow:<run_id>'.*W&B offline run"):
        load_baseline(tmp_path / "empty")
    with pytest.raises(ConfigError, match="has no run id"):
        load_baseline("mlflow:")


def test_loss_gap_alignment():
    b = Baseline("ctl", {0: 4.0, 10: 2.0, 20: 1.0})
    assert b.step_spacing == 10
    assert loss_gap(10, 2.5, b) == (0.5, 0.25)
    assert loss_gap(19, 2.5, b) == (0.5, 0.25)  # nearest earlier logged step is 10
    assert loss_gap(31, 1.0, b) is None  # 11 steps past the last control step > spacing
    assert loss_gap(25, 1.5, b, max_lag=5) == (0.5, 0.5)
    assert loss_gap(-1, 1.0, b) is None
    assert loss_gap(10, math.nan, b) is None


def _ev(start, recover, kind="spike"):
    end = None if recover is None else start + recover
    return SpikeEvent(
        kind,
        start,
        start,
        5.0,
        3.0,
        0.1,
        20.0,
        recover,
        end,
        None,
        "recovered" if recover is not None else "not_recovered",
    )


def test_classify_shared_and_fp8_only_with_recovery():
    b = Baseline("ctl", {}, (_ev(100, 10), _ev(500, None), _ev(900, 10, "nonfinite")))
    shared = classify_spike(_ev(130, 15), b, window=50)
    assert (shared.label, shared.control_start_step, shared.step_offset) == ("shared", 100, 30)
    assert (shared.recover_ratio, shared.slower_recovery) == (1.5, False)
    assert classify_spike(_ev(90, None), b).slower_recovery is True  # control recovered, FP8 did not
    assert classify_spike(_ev(510, 5), b).slower_recovery is False  # control never recovered
    only = classify_spike(_ev(300, 40), b)
    assert (only.label, only.control_start_step, only.recover_ratio) == ("fp8_only", None, None)
    assert classify_spike(_ev(900, 1), b).label == "fp8_only"  # a control NaN is not a loss spike
    rec = _ev(300, 40).to_record(only)
    assert rec.data["alert"] is True and rec.data["level"] == "WARN" and rec.data["control"] == "fp8_only"
    assert "alert" not in _ev(130, 15).to_record(shared).data
    summary = spike_summary([_ev(130, 15), _ev(300, 40), _ev(700, None)], b)
    assert summary == {
        "fp8_spikes": 3,
        "shared": 1,
        "fp8_only": 2,
        "control_spikes": 2,
        "fp8_median_recover_steps": 27.5,
        "control_median_recover_steps": 10.0,
        "fp8_not_recovered": 1,
        "control_not_recovered": 1,
    }
    with pytest.raises(ConfigError, match="window must be an integer >= 0"):
        classify_spike(_ev(1, 1), b, window=-1)
