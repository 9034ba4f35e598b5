"""``fp8track sweep`` runs the NVFP4 sweep YAML (integrations/wandb/nvfp4_sweep.yaml: recipe
``nvfp4`` and the last-fraction fallback ``last:15%,head``) locally: the example program trains
each trial with the emulated NVFP4 recipe, logs into its MLflow child run, and the sweep
recommends from the measured gaps."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

pytest.importorskip("optuna")
pytest.importorskip("mlflow")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
YAML = ROOT / "integrations" / "wandb" / "nvfp4_sweep.yaml"


def test_nvfp4_sweep_yaml_runs_locally(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("FP8TRACK_STATS_KERNEL", "eager")
    spec = yaml.safe_load(YAML.read_text())
    assert "nvfp4" in spec["parameters"]["recipe"]["values"]
    assert "last:15%,head" in spec["parameters"]["bf16_layers"]["values"]
    # The same YAML, sized for a test: one trial of a tiny budget (and its BF16 control).
    spec["parameters"] = {
        "recipe": {"values": ["nvfp4"]},
        "bf16_layers": {"values": ["last:15%,head"]},
        "steps": {"value": 4},
        "eval_every": {"value": 2},
        "eval_batches": {"value": 1},
        "batch_size": {"value": 4},
        "block_size": {"value": 16},
        "n_embd": {"value": 32},
        "max_bytes": {"value": 20000},
        "control_seeds": {"value": 1},
        "precision": {"value": "32-true"},
        "seed": {"value": 0},
    }
    path = tmp_path / "nvfp4.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    from fp8track.cli import main

    out = tmp_path / "out"
    assert main(["sweep", str(path), "--out", str(out), "--trials", "1", "--no-progress",
                 "--finalists", "0", "--control-seeds", "1"]) == 0
    from mlflow.tracking import MlflowClient

    from fp8track.sweep.executor import find_parent

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    exp_id, parent = find_parent(client, spec["name"])
    trials = client.search_runs(
        [exp_id], filter_string=f"tags.mlflow.parentRunId = '{parent}' and tags.`fp8track.role` = 'trial'"
    )
    got = sorted((r.data.params["recipe"], r.data.params["bf16_layers"]) for r in trials)
    assert got == [("nvfp4", "last:15%,head")]
    for r in trials:
        assert r.info.status == "FINISHED"
        assert client.get_metric_history(r.info.run_id, "fp8/val_loss")
