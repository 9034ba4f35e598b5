"""Where users really train, each set-up real and each asserting counts (issue 20's matrix):
Hugging Face ``Trainer`` with gradient accumulation (both of HF's loss normalisations), LoRA
adapters (peft) under the Trainer, Lightning Fabric, a bf16-mixed Lightning Trainer with
accumulation, and manual optimisation whose ``training_step`` returns nothing.

Every row checks, on each sampled step, that the layers monitored are exactly the layers that ran
a GEMM and that each tensor's ``numel`` is what those GEMMs saw (an independent recorder of forward
calls, :class:`GemmRecorder`), and that ``fp8/loss`` equals the loss the user's framework reports.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable

import pytest
import torch

import fp8track
from fp8track.monitoring.naming import LOSS_METRIC, canonical_layer_names, run_metric
from fp8track.monitoring.records import RunReader

from helpers.lightning import quiet_trainer

pytestmark = pytest.mark.slow


class GemmRecorder:
    """What every ``nn.Linear`` of ``model`` computed, per optimizer step (``step()`` says which):
    activation numel = the inputs' elements summed over the calls, weight numel = the weight's,
    gradient numel = the outputs' elements over the calls whose output takes a gradient (dY)."""

    def __init__(self, model: torch.nn.Module, step: Callable[[], int]) -> None:
        self.step = step
        self.seen: dict[int, dict[tuple[str, str], float]] = defaultdict(lambda: defaultdict(float))
        linears = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        # Records carry canonical names (wrappers and a LightningModule's holder attribute dropped).
        names = canonical_layer_names(model, [name for name, _ in linears])
        self.handles = [
            m.register_forward_hook(self._hook(name)) for name, (_, m) in zip(names, linears, strict=True)
        ]

    def _hook(self, name: str):
        def hook(module, args, output):
            if not torch.is_grad_enabled():
                return  # validation / generation: not a training GEMM
            seen = self.seen[self.step()]
            seen[(name, "activation")] += args[0].numel()
            seen[(name, "weight")] = float(module.weight.numel())
            if output.requires_grad:
                seen[(name, "gradient")] += output.numel()

        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def assert_counts_match(run_dir, recorder: GemmRecorder, sampled: list[int]) -> None:
    rows = [r for r in RunReader(run_dir).tensor_stats() if r.variant in ("actual", "shadow")]
    assert sorted({r.step for r in rows}) == sampled
    for step in sampled:
        monitored = {(r.layer, r.tensor): r.stats["numel"] for r in rows if r.step == step}
        assert monitored == dict(recorder.seen[step]), f"step {step}"


def logged_losses(run_dir) -> dict[int, float]:
    return {m.step: m.metrics[LOSS_METRIC] for m in RunReader(run_dir).metrics() if LOSS_METRIC in m.metrics}


# -- Hugging Face Trainer -------------------------------------------------------------------------------
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(cfg)


def token_data(n: int = 24, seq: int = 8):
    """Sequences whose number of predicted tokens differs (1 to 5 leading labels masked), so a
    per-token mean over the accumulated batch differs from the mean of per-micro-batch means."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        ids = torch.randint(0, 64, (seq,), generator=g)
        labels = ids.clone()
        labels[: (i % 5) + 1] = -100
        out.append({"input_ids": ids, "labels": labels, "attention_mask": torch.ones(seq, dtype=torch.long)})
    return out


def hf_trainer(model, tmp_path, steps: int = 3, accumulation: int = 2, report_to="none"):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=accumulation,
        max_steps=steps,
        logging_steps=1,
        report_to=report_to,
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        learning_rate=1e-2,
        seed=0,
        max_grad_norm=0.5,
    )
    return Trainer(model=model, args=args, train_dataset=token_data())


def hf_logs(trainer) -> dict[int, dict]:
    """HF's own per-step logs by step (fp8track numbers the steps as HF does: from 1)."""
    return {h["step"]: h for h in trainer.state.log_history if "loss" in h}


@pytest.mark.parametrize(
    "tokens_normalise", [True, False], ids=["num_items_in_batch", "divide_by_accumulation"]
)
def test_hf_trainer_with_accumulation_records_the_loss_hf_logs(tmp_path, tokens_normalise):
    from fp8track.hf import FP8TrainerCallback

    model = tiny_llama()
    report = fp8track.apply_fp8(model, "delayed", backend="emulated")
    trainer = hf_trainer(model, tmp_path)
    # HF divides each micro-batch's loss by the accumulation steps unless the model normalises it
    # by the accumulated batch's token count itself (num_items_in_batch); fp8track must match both.
    trainer.model_accepts_loss_kwargs = tokens_normalise
    recorder = GemmRecorder(model, lambda: trainer.state.global_step + 1)
    cb = FP8TrainerCallback(every_n_steps=2, trackers="none").attach(trainer)
    trainer.train()
    recorder.close()

    hf = hf_logs(trainer)
    ours = logged_losses(cb.run_dir)
    assert sorted(ours) == sorted(hf) == [1, 2, 3]
    for step in hf:
        assert ours[step] == pytest.approx(hf[step]["loss"], rel=1e-6, abs=0)
    # the grad norm of sampled steps: HF's (before clipping to 0.5), the steps HF clipped included
    grad_norms = {m.step: m.metrics[run_metric("grad_norm")] for m in RunReader(cb.run_dir).metrics()
                  if run_metric("grad_norm") in m.metrics}
    assert sorted(grad_norms) == [2]
    for step, value in grad_norms.items():
        assert value == pytest.approx(hf[step]["grad_norm"], rel=1e-5)
    assert any(hf[s]["grad_norm"] > 0.5 for s in grad_norms)  # clipping happened after the norm was read
    assert_counts_match(cb.run_dir, recorder, [2])
    # Every FP8 layer (all 15 linear layers of the 2-block Llama) ran and is monitored.
    assert {r.layer for r in RunReader(cb.run_dir).tensor_stats()} == set(report.fp8_layers) and len(
        report.fp8_layers
    ) == 15
    assert [e.kind for e in cb.events] == ["run_end"]


def test_hf_trainer_report_to_mlflow_puts_fp8_metrics_beside_hf_loss(tmp_path, monkeypatch):
    import mlflow
    from mlflow.tracking import MlflowClient

    from fp8track.hf import FP8TrainerCallback

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # what HF's MLflowCallback reads
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "hf-fp8")
    # an earlier test's MLFlowLogger leaves mlflow's process-wide tracking URI set, which HF's
    # callback keeps: this store is named explicitly, and the old one restored afterwards
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    trainer = hf_trainer(tiny_llama(), tmp_path, steps=2, report_to=["mlflow"])
    cb = FP8TrainerCallback(every_n_steps=1).attach(trainer)  # trackers="auto": HF's active MLflow run
    try:
        trainer.train()
    finally:
        if mlflow.active_run() is not None:
            mlflow.end_run()
        mlflow.set_tracking_uri(previous)
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("hf-fp8").experiment_id])
    history = {
        k: {m.step: m.value for m in client.get_metric_history(run.info.run_id, k)}
        for k in ("loss", LOSS_METRIC)
    }
    assert (
        sorted(history[LOSS_METRIC]) == sorted(history["loss"]) == [1, 2]
    )  # the same steps as HF's own loss
    assert history[LOSS_METRIC] == pytest.approx(history["loss"], rel=1e-6)
    assert run.data.tags["fp8track.run_id"] == RunReader(cb.run_dir).meta()["run_id"]
    assert any(
        k.startswith("fp8/model.layers.0.self_attn.q_proj/") for k in run.data.metrics
    )  # shadow statistics


def test_hf_trainer_report_to_wandb_puts_fp8_metrics_in_hf_wandb_run(tmp_path, monkeypatch):
    from fp8track.analysis.baseline import load_run
    from fp8track.hf import FP8TrainerCallback

    monkeypatch.setenv("WANDB_MODE", "offline")  # read by HF's WandbCallback's wandb.init
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    import wandb

    wandb.teardown()  # W&B reads its settings once per process: an earlier test's must not stay
    trainer = hf_trainer(tiny_llama(), tmp_path, steps=2, report_to=["wandb"])
    cb = FP8TrainerCallback(every_n_steps=1).attach(trainer)  # trackers="auto": HF's W&B run
    try:
        trainer.train()
    finally:
        if wandb.run is not None:
            wandb.run.finish()
    run = load_run(tmp_path / "wandb")  # the one offline run HF opened, read back with wandb leet
    assert run.metrics[LOSS_METRIC] == pytest.approx(
        {s: h["loss"] for s, h in hf_logs(trainer).items()}, rel=1e-6
    )
    assert sorted(run.metrics[LOSS_METRIC]) == [1, 2] and cb.run_dir is not None
    assert any(k.startswith("fp8/model.layers.1.mlp.down_proj/") for k in run.metrics)


def test_hf_trainer_with_lora_adapters_monitors_the_base_layers(tmp_path):
    from peft import LoraConfig, get_peft_model

    from fp8track.hf import FP8TrainerCallback

    base = tiny_llama()
    report = fp8track.apply_fp8(base, "current", backend="emulated")
    model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    )
    trainer = hf_trainer(model, tmp_path, steps=2)
    recorder = GemmRecorder(model.get_base_model(), lambda: trainer.state.global_step + 1)
    cb = FP8TrainerCallback(every_n_steps=1, trackers="none").attach(trainer)
    trainer.train()
    recorder.close()

    hf = hf_logs(trainer)
    assert logged_losses(cb.run_dir) == pytest.approx({s: h["loss"] for s, h in hf.items()}, rel=1e-6)
    assert_counts_match(cb.run_dir, recorder, [1, 2])
    layers = {r.layer for r in RunReader(cb.run_dir).tensor_stats()}
    # The FP8 base GEMMs keep the names they have without LoRA (no "base_model.model." prefix, no
    # ".base_layer"), so a LoRA run compares layer by layer with a plain one; the adapters' own GEMMs
    # are monitored beside them.
    adapters = {
        f"model.layers.{i}.self_attn.{p}.lora_{ab}.default"
        for i in (0, 1)
        for p in ("q_proj", "v_proj")
        for ab in "AB"
    }
    assert layers == set(report.fp8_layers) | adapters and len(report.fp8_layers) == 15 and len(adapters) == 8
    # The frozen base layers still pass dY on wherever the graph needs it (every block after the
    # adapters of block 0), and their weights have no gradient of their own.
    assert all(p.grad is None for n, p in model.named_parameters() if "base_layer" in n)


# -- Lightning Fabric -------------------------------------------------------------------------------------
def test_fabric_loop_with_the_plain_monitor(tmp_path):
    from lightning.fabric import Fabric

    torch.manual_seed(0)
    fabric = Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32),
        torch.nn.GELU(),
        torch.nn.Linear(32, 32),
        torch.nn.GELU(),
        torch.nn.Linear(32, 1),
    )
    fp8track.apply_fp8(model, "current", backend="emulated")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = fabric.setup(model, opt)  # a _FabricModule: its submodules are named _forward_module.*
    step = [0]
    recorder = GemmRecorder(model.module, lambda: step[0])
    g = torch.Generator().manual_seed(3)
    losses = {}
    with fp8track.Monitor(model, {"every_n_steps": 2}, log_dir=tmp_path / "runs") as mon:
        for step[0] in range(5):
            x = torch.randn(8, 16, generator=g)
            loss = model(x).float().pow(2).mean()
            fabric.backward(loss)
            opt.step()
            mon.step(loss=loss)
            opt.zero_grad()
            losses[step[0]] = loss.item()
    recorder.close()
    assert logged_losses(mon.run_dir) == pytest.approx(losses, rel=1e-6)
    assert {r.layer for r in RunReader(mon.run_dir).tensor_stats()} == {
        "0",
        "2",
        "4",
    }  # no "_forward_module."
    assert_counts_match(mon.run_dir, recorder, [0, 2, 4])
    assert mon.closed  # the with-block closed it


# -- Lightning Trainer: bf16-mixed with accumulation; manual optimisation without a loss ------------------
def _lightning_data(n: int = 64):
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


def _lightning_net(manual: bool, returns_loss: bool = True):
    import lightning.pytorch as pl

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
            self.automatic_optimization = not manual
            self.micro_losses: dict[int, list[float]] = defaultdict(list)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.body(x).float(), y)
            self.micro_losses[self.global_step].append(loss.item())
            if manual:
                opt = self.optimizers()
                opt.zero_grad()
                self.manual_backward(loss)
                opt.step()
            return loss if returns_loss else None

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    return Net()


def test_lightning_bf16_mixed_with_accumulation(tmp_path):

    net = _lightning_net(manual=False)
    fp8track.apply_fp8(net, "delayed", backend="emulated")
    monitor = fp8track.FP8Monitor(every_n_steps=2, trackers="none", log_dir=str(tmp_path / "runs"))
    trainer = quiet_trainer(
        tmp_path,
        [monitor],
        max_steps=4,
        accumulate_grad_batches=2,
        precision="bf16-mixed",
    )
    recorder = GemmRecorder(net, lambda: trainer.global_step)
    trainer.fit(net, _lightning_data())
    recorder.close()
    # fp8/loss is the user's un-normalised loss, the mean of the step's 2 micro-batches (Lightning
    # divides by accumulate_grad_batches; the monitor undoes it).
    expected = {s: sum(v) / len(v) for s, v in net.micro_losses.items()}
    assert sorted(expected) == [0, 1, 2, 3] and all(len(v) == 2 for v in net.micro_losses.values())
    assert logged_losses(monitor.run_dir) == pytest.approx(expected, rel=1e-5)
    assert_counts_match(monitor.run_dir, recorder, [0, 2])
    meta = RunReader(monitor.run_dir).meta()
    assert meta["config"]["precision"]["precision"] == "bf16-mixed"


def test_manual_optimisation_without_a_returned_loss_is_no_alarm(tmp_path):

    net = _lightning_net(manual=True, returns_loss=False)
    monitor = fp8track.FP8Monitor(
        every_n_steps=2, trackers="none", on_spike="stop", log_dir=str(tmp_path / "runs")
    )
    trainer = quiet_trainer(tmp_path, [monitor], max_steps=6)
    recorder = GemmRecorder(net, lambda: trainer.global_step)
    trainer.fit(net, _lightning_data())
    recorder.close()
    assert trainer.global_step == 6  # on_spike="stop" did not end the run
    reader = RunReader(monitor.run_dir)
    losses = [m.metrics[LOSS_METRIC] for m in reader.metrics() if LOSS_METRIC in m.metrics]
    assert not any(math.isnan(v) for v in losses)  # no loss given: none recorded, never a NaN
    assert [e.kind for e in reader.events()] == ["run_end"]
    assert_counts_match(monitor.run_dir, recorder, [0, 2, 4])
