"""A trial's settings (CLI and the W&B agent's parameter file), the shared JSON cache, and the
``auto:K`` ranking table."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from fp8track.analysis.ranking import rank_layers
from fp8track.errors import ConfigError
from fp8track.monitoring.records import TensorStatsRow
from fp8track.trial import JsonCache, cache_key, ranking_table, read_param_file, trial_settings


def _param_file(tmp_path: Path, **values) -> Path:
    """What the W&B agent writes (wandb.sdk.lib.config_util.save_config_file_from_dict)."""
    import yaml

    p = tmp_path / "config.yaml"
    p.write_text(yaml.safe_dump({"wandb_version": 1, **{k: {"value": v} for k, v in values.items()}}))
    return p


def test_command_line_wins_over_the_param_file(tmp_path: Path) -> None:
    path = _param_file(tmp_path, recipe="mxfp8", bf16_layers="auto:2", lr=0.01)
    s = trial_settings(["--recipe=delayed:hybrid:h16:max", "--steps=5"], param_path=path)
    assert s.recipe.name == "delayed" and s.recipe.amax_history_len == 16
    assert s.spec == "auto:2" and s.bf16_layers.needs_ranking
    assert s.params["lr"] == 0.01 and s.control is None


def test_param_file_from_the_environment_on_ranks_without_wandb_config(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(
        "WANDB_SWEEP_PARAM_PATH", str(_param_file(tmp_path, recipe="block", bf16_layers="first_last"))
    )
    s = trial_settings([])
    assert (s.recipe.name, s.spec) == ("block", "first:1,last:1,head")
    assert read_param_file(_param_file(tmp_path, recipe="current")) == {"recipe": "current"}


def test_defaults_and_bad_values() -> None:
    s = trial_settings([], param_path="")
    assert (s.recipe.name, s.spec) == ("delayed", "none")
    with pytest.raises(ConfigError, match="unknown recipe name 'fp6'"):
        trial_settings(["--recipe", "fp6"], param_path="")
    with pytest.raises(ConfigError, match="needs a positive integer count"):
        trial_settings(["--bf16-layers", "last:x"], param_path="")


def test_json_cache_computes_once_per_key(tmp_path: Path) -> None:
    cache = JsonCache(tmp_path)
    calls = []

    def compute():
        calls.append(1)
        return {"value": len(calls)}

    first, cached1 = cache.get_or_compute("control", {"seed": 0, "steps": 10}, compute)
    again, cached2 = JsonCache(tmp_path).get_or_compute(
        "control", {"steps": 10, "seed": 0}, compute
    )  # key order irrelevant
    other, cached3 = cache.get_or_compute("control", {"seed": 1, "steps": 10}, compute)
    assert (first["value"], again["value"], other["value"]) == (1, 1, 2)
    assert (cached1, cached2, cached3) == (False, True, False)
    assert cache_key({"a": 1}) != cache_key({"a": 2}) and len(cache_key({"a": 1})) == 16


def test_ranking_table_follows_rank_layers() -> None:
    """Three layers, one with a far lower SQNR and a high underflow share: rank 1 in the table."""
    rows = []
    for step in range(3):
        for layer, sqnr, under in (("a", 30.0, 0.1), ("b", 31.0, 0.2), ("c", 8.0, 12.0), ("d", 30.5, 0.1)):
            rows.append(
                TensorStatsRow(
                    step,
                    layer,
                    "activation",
                    {
                        "sqnr_db": sqnr,
                        "cos": 0.999,
                        "underflow_pct": under,
                        "overflow_pct": 0.0,
                        "scale_drift_log2": 0.0,
                        "mse": 1e-4,
                        "amax": 1.0,
                    },
                )
            )
    table = ranking_table(rank_layers(rows))
    assert [r["layer"] for r in table][0] == "c" and table[0]["rank"] == 1
    # rel_error_db = -sqnr: median of (-31, -30.5, -30, -8) is -30.25, MAD 0.5 -> 0.74 < floor 1 dB:
    # z = (-8 + 30.25) / 1. Underflow: median 0.15, MAD 0.05 -> 0.074 < floor 0.5: z = (12 - 0.15) / 0.5.
    assert table[0]["z_rel_error_db"] == pytest.approx(22.25, rel=1e-9)
    assert table[0]["z_underflow_pct"] == pytest.approx((12.0 - 0.15) / 0.5, rel=1e-6)
    assert all(r["score"] is None or math.isfinite(r["score"]) for r in table)


def test_sweep_environment_reaches_the_program(tmp_path: Path, monkeypatch) -> None:
    """What ``fp8track sweep`` sets: MLflow's own run id and URI, the control, the auto:K ranking."""
    import json

    ranking = tmp_path / "ranking.json"
    ranking.write_text(json.dumps(["model.model.lm_head", "model.model.layers.0.q"]))
    monkeypatch.setenv("MLFLOW_RUN_ID", "abc123")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///x.db")
    monkeypatch.setenv("FP8TRACK_SWEEP_CONTROL", "mlflow:ctl")
    monkeypatch.setenv("FP8TRACK_SWEEP_RANKING", str(ranking))
    s = trial_settings(["--recipe=current", "--bf16_layers=auto:1"], param_path="")
    assert (s.run_id, s.tracking_uri, s.control, s.in_sweep) == (
        "abc123",
        "sqlite:///x.db",
        "mlflow:ctl",
        True,
    )
    assert s.ranking == ("model.model.lm_head", "model.model.layers.0.q")
    logger = s.mlflow_logger()
    assert type(logger).__name__ == "MLFlowLogger" and logger._run_id == "abc123"
    monkeypatch.setenv("FP8TRACK_SWEEP_RANKING", str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="cannot read the auto:K ranking"):
        trial_settings([], param_path="")


def test_flop_share_weighs_layers_by_their_shape_and_rankings_align_to_the_converted_model() -> None:
    from torch import nn

    from fp8track.trial import align_ranking, fp8_flop_share, layer_costs

    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 256))
    costs = layer_costs(model)
    assert [(c.name, c.in_features, c.out_features) for c in costs] == [("0", 64, 64), ("2", 64, 256)]
    assert fp8_flop_share(costs, ["0"]) == pytest.approx(4096 / (4096 + 16384))
    assert fp8_flop_share(costs, ["0", "2"]) == 1.0 and math.isnan(fp8_flop_share([], []))
    assert align_ranking(["model.2", "model.0", "model.9"], ["0", "2"]) == ["2", "0"]


def test_apply_outside_a_sweep_converts_with_the_trials_settings(monkeypatch) -> None:
    from torch import nn

    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    s = trial_settings(["--recipe=current", "--bf16_layers=last:1"], param_path="")
    report = s.apply(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)), backend="emulated")
    assert report.fp8_layers == ("0",) and [n for n, _ in report.bf16_layers] == ["1"]
    assert s.mlflow_logger() is None


def test_the_layer_table_marks_experts_converted_whole_as_fp8(tmp_path: Path, monkeypatch) -> None:
    """An all-FP8 Qwen3-MoE trial (``bf16_layers=none``): the experts module runs in FP8, so its
    projections' rows in ``fp8track_layers.json`` say ``fp8: true`` and the table's own share is the
    logged ``fp8_flop_share``. Before, the rows compared the projection's name with the converted
    module's, so every expert projection read ``fp8: false`` (table share 0.40, logged 0.99 on a
    two-layer Mixtral sweep) and the torchao information skipped them."""
    import json

    pytest.importorskip("transformers")
    mlflow = pytest.importorskip("mlflow")
    from fp8track.trial import FLOP_SHARE_METRIC, LAYERS_ARTIFACT

    from helpers.moe import tiny_moe

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.tracking.MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("t")).info.run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", run_id)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    s = trial_settings(["--recipe=current", "--bf16_layers=none"], param_path="")
    report = s.apply(tiny_moe("qwen3moe"), backend="emulated")
    assert any(n.endswith("mlp.experts") for n in report.fp8_layers)
    table = Path(client.download_artifacts(run_id, LAYERS_ARTIFACT, str(tmp_path)))
    rows = json.loads(table.read_text())["layers"]
    experts = [r for r in rows if ".experts." in r["layer"]]
    assert experts and all(r["fp8"] for r in experts), experts
    share = sum(r["macs_per_token"] for r in rows if r["fp8"]) / sum(r["macs_per_token"] for r in rows)
    assert share == pytest.approx(client.get_run(run_id).data.metrics[FLOP_SHARE_METRIC])
