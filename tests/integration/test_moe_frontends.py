"""Mixture-of-experts runs through every frontend and store: a real Lightning Trainer with MLflow
(SQLite) and W&B (offline) loggers, the Hugging Face Trainer, and the diagnosis of an FP8 MoE run
against its BF16 control read back from the run directories."""

from __future__ import annotations

import pytest
import torch

from helpers.moe import E, K, batch, tiny_moe

pytest.importorskip("mlflow")
pytest.importorskip("wandb")

import lightning.pytorch as pl  # noqa: E402

import fp8track  # noqa: E402
from fp8track.analysis.baseline import load_run  # noqa: E402
from fp8track.monitoring.naming import run_metric  # noqa: E402

from helpers.lightning import quiet_trainer

pytestmark = pytest.mark.slow
BLOCK = "model.layers.1.mlp"


class _MoEModule(pl.LightningModule):
    def __init__(self, recipe: str | None) -> None:
        super().__init__()
        self.model = tiny_moe("mixtral")
        self.report = fp8track.apply_fp8(self.model, recipe, backend="emulated") if recipe else None

    def training_step(self, ids, _):
        return self.model(ids, labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(batch(0, b=12), batch_size=2)


def _fit(tmp_path, name: str, recipe: str | None, uri: str, experiment: str) -> dict:
    from lightning.pytorch.loggers import MLFlowLogger, WandbLogger

    module = _MoEModule(recipe)
    ml = MLFlowLogger(experiment_name=experiment, run_name=name, tracking_uri=uri)
    wb_dir = tmp_path / f"wandb_{name}"
    wb_dir.mkdir()
    # mode="offline" goes to wandb.init itself: offline=True alone only exports WANDB_MODE, which an
    # earlier test's wandb settings in this process can override (then wandb asks for an API key)
    wb = WandbLogger(project="moe", name=name, save_dir=str(wb_dir), offline=True, mode="offline")
    monitor = fp8track.FP8Monitor(every_n_steps=2, apply_report=module.report)
    trainer = quiet_trainer(tmp_path, [monitor], max_epochs=1, logger=[ml, wb])
    trainer.fit(module)
    wb.experiment.finish()
    return {"dir": monitor.run_dir, "mlflow": f"mlflow:{ml.run_id}", "wandb": wb_dir / "wandb"}


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory, _mlflow_db):
    """The control and the FP8 run, trained once for this module's tests (which only read them)."""
    from helpers.mlflow_store import MlflowStore

    root = tmp_path_factory.mktemp("moe_pair")
    store = MlflowStore(_mlflow_db, f"{__name__}/moe_pair")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_SILENT", "true")
        # WandbLogger(offline=True) exports WANDB_MODE; the context restores it for later tests
        mp.setenv("WANDB_MODE", "offline")
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)  # MLFlowLogger exports it; restored on exit
        mp.chdir(root)  # FP8Monitor's default run directory, MLflow's and W&B's defaults
        refs = {
            name: _fit(root, name, recipe, store.uri, store.experiment("moe"))
            for name, recipe in (("control", None), ("fp8", "current"))
        }
    return refs, store.uri


def test_moe_rows_and_router_metrics_reach_the_run_dir_mlflow_and_wandb(moe_pair):
    refs, uri = moe_pair
    for name, ref in refs.items():
        variant = "actual" if name == "fp8" else "shadow"
        for source in ("dir", "mlflow", "wandb"):
            run = load_run(ref[source], tracking_uri=uri) if source == "mlflow" else load_run(ref[source])
            rows = [r for r in run.tensor_rows if r.layer.startswith(f"{BLOCK}.experts.")]
            experts = {r.layer for r in rows if ".expert_" in r.layer}
            assert {f"{BLOCK}.experts.gate_up_proj.expert_{e}" for e in range(E)} <= experts | {
                r.layer for r in rows}, (name, source)
            agg = [r for r in rows if r.layer == f"{BLOCK}.experts.gate_up_proj" and r.tensor == "activation"]
            assert agg and all(r.variant == variant for r in agg), (name, source)
            assert all(r.stats["tokens"] == 2 * 8 * K for r in agg), (
                name,
                source,
            )  # batch 2 x 8 tokens, top-2
            aux = run.metrics[run_metric("router", "aux_loss")]
            assert sorted(aux) == [0, 2, 4] and all(1.0 <= v <= E for v in aux.values()), (name, source)
        # the experts x steps heatmap: an MLflow figure and a W&B image
        from mlflow import MlflowClient

        artifacts = {a.path for a in MlflowClient(uri).list_artifacts(ref["mlflow"].removeprefix("mlflow:"))}
        assert "fp8_experts_heatmap.png" in artifacts, name
        images = list((ref["wandb"]).rglob("*experts_heatmap*.png"))
        assert images and images[0].read_bytes()[:4] == b"\x89PNG", name


def test_moe_pair_is_diagnosed_from_run_directories(tmp_path, moe_pair):
    from fp8track.report.run import diagnose_runs

    refs = moe_pair[0]
    out = diagnose_runs(str(refs["fp8"]["dir"]), str(refs["control"]["dir"]), tmp_path / "diag")
    assert (tmp_path / "diag" / "report.html").exists()
    d = out.diagnosis
    assert [f.kind for f in d.findings] == ["healthy"]  # no false alarm on a healthy MoE pair
    ranked = {r.layer for r in d.layer_ranking}
    assert f"{BLOCK}.experts.down_proj.expert_0" in ranked and f"{BLOCK}.experts.down_proj" in ranked


def test_hf_trainer_records_expert_rows(tmp_path):
    from transformers import Trainer, TrainingArguments

    from fp8track.hf import FP8TrainerCallback

    model = tiny_moe("mixtral")
    fp8track.apply_fp8(model, "delayed", backend="emulated")
    data = [{"input_ids": ids, "labels": ids} for ids in batch(1, b=12)]
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), per_device_train_batch_size=2, max_steps=2,
                             logging_steps=1, report_to="none", use_cpu=True, save_strategy="no",
                             disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    cb = FP8TrainerCallback(every_n_steps=1, trackers="none").attach(trainer)
    trainer.train()
    run = load_run(cb.run_dir)
    layers = {r.layer for r in run.tensor_rows}
    assert f"{BLOCK}.experts.down_proj.expert_0" in layers or f"{BLOCK}.experts.down_proj.expert_1" in layers
    scales = [r.stats["scale"] for r in run.tensor_rows
              if r.layer.startswith(f"{BLOCK}.experts.gate_up_proj.expert_") and r.tensor == "activation"]
    assert scales and all(s > 0 for s in scales)
