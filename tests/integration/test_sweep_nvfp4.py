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


def _tiny_parameters(bf16_layers: str, **extra: dict) -> dict:
    """The sweep's parameters for one nvfp4 trial of a tiny budget (4 steps of a 32-wide model)."""
    fixed = {"steps": 4, "eval_every": 2, "eval_batches": 1, "batch_size": 4, "block_size": 16, "n_embd": 32,
             "max_bytes": 20000, "control_seeds": 1, "precision": "32-true", "seed": 0}
    return {"recipe": {"values": ["nvfp4"]}, "bf16_layers": {"values": [bf16_layers]},
            **{k: {"value": v} for k, v in fixed.items()}, **extra}


def test_nvfp4_sweep_yaml_runs_locally(tmp_path: Path, monkeypatch) -> None:
    """Long (about 35 s): the YAML's program trains the trial and its control, a subprocess each."""
    monkeypatch.setenv("FP8TRACK_STATS_KERNEL", "eager")
    spec = yaml.safe_load(YAML.read_text())
    assert "nvfp4" in spec["parameters"]["recipe"]["values"]
    assert "last:15%,head" in spec["parameters"]["bf16_layers"]["values"]
    # The same YAML, sized for a test: one trial of a tiny budget (and its BF16 control).
    spec["parameters"] = _tiny_parameters("last:15%,head")
    path = tmp_path / "nvfp4.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    from fp8track.cli import main

    out = tmp_path / "out"
    assert main(["sweep", str(path), "--out", str(out), "--trials", "1", "--no-progress",
                 "--finalists", "0", "--control-seeds", "1"]) == 0
    from mlflow.tracking import MlflowClient

    from fp8track.sweep.mlflow_runs import find_parent

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


def test_auto_k_for_nvfp4_is_ranked_from_the_controls_whatif_rows(tmp_path: Path, monkeypatch) -> None:
    """``--auto-from whatif``: the BF16 control is recorded with ``whatif=["nvfp4"]`` and ``auto:1``
    is ranked from its nvfp4 rows alone; no all-NVFP4 probe run is trained.
    Long (about 40 s): the control and the trial train as subprocesses."""
    import json

    from mlflow.tracking import MlflowClient

    from fp8track.analysis.baseline import load_run
    from fp8track.analysis.ranking import rank_layers
    from fp8track.cli import main
    from fp8track.monitoring.records import TensorStatsRow
    from fp8track.sweep.mlflow_runs import find_parent

    monkeypatch.setenv("FP8TRACK_STATS_KERNEL", "eager")
    spec = yaml.safe_load(YAML.read_text())
    spec["name"] = "nvfp4-auto-whatif"
    spec["parameters"] = _tiny_parameters("auto:1", every_n_steps={"value": 2})
    path = tmp_path / "nvfp4_auto.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    out = tmp_path / "out"
    assert main(["sweep", str(path), "--out", str(out), "--trials", "1", "--no-progress",
                 "--finalists", "0", "--control-seeds", "1", "--auto-from", "whatif"]) == 0

    uri = f"sqlite:///{out / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp_id, parent = find_parent(client, spec["name"])

    def role(name: str) -> list:
        return client.search_runs([exp_id], filter_string=(
            f"tags.mlflow.parentRunId = '{parent}' and tags.`fp8track.role` = '{name}'"))

    assert client.get_run(parent).data.params["auto_from"] == "whatif"
    assert role("probe") == []  # nothing trained in NVFP4 but the trial itself
    (control,) = role("control")
    rows = load_run(f"mlflow:{control.info.run_id}", uri).tensor_rows
    assert {"shadow", "nvfp4", "nvfp4_columnwise"} <= {r.variant for r in rows}
    # Independently: the nvfp4 rows relabelled as a run's own (actual) rows, the shadow rows dropped.
    relabelled = [TensorStatsRow(r.step, r.layer, r.tensor, r.stats, r.variant.replace("nvfp4", "actual"))
                  for r in rows if r.variant in ("nvfp4", "nvfp4_columnwise")]
    want = [risk.layer for risk in rank_layers(relabelled)]
    (ranking_file,) = (out / "rankings").glob("*.json")
    assert json.loads(ranking_file.read_text()) == want
    (trial,) = role("trial")
    kept = trial.data.tags["fp8track.bf16_layer_names"].split(",")
    assert len(kept) == 1 and (kept[0] == want[0] or kept[0].endswith("." + want[0]))  # apply's names
