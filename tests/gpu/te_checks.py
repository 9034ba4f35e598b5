"""GPU checks of fp8track's Transformer Engine path, one check per process.

Run by tests/gpu/test_te.py (``make test-gpu``) as ``python tests/gpu/te_checks.py <check> <out_dir>``.
Each check writes ``<out_dir>/result.json`` with what it measured; the test asserts. A separate
process per check because nvdlfw_inspect keeps global state and TE refuses to start debugging
after TE modules exist (``TEDebugState.initialize``): each check initialises the debug API
before building its first TE module. Nothing here catches an exception: an error fails the test.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

from fp8track.execution.apply import apply_fp8
from fp8track.monitoring import te_capture
from fp8track.monitoring.monitor import CaptureConfig as MonitorConfig
from fp8track.monitoring.monitor import MonitorCore as Monitor
from fp8track.monitoring.records import RunReader
from fp8track.trackers.nvdlfw import TEStatsBridge

TENSORS = ["activation", "weight", "gradient"]


def _rows(run_dir: Path) -> list[dict]:
    return [
        {"step": r.step, "layer": r.layer, "tensor": r.tensor, "variant": r.variant, "stats": dict(r.stats)}
        for r in RunReader(run_dir).tensor_stats()
    ]


def _bridge_rows(batches: list) -> list[dict]:
    return [
        {"step": r.step, "layer": r.layer, "tensor": r.tensor, "variant": r.variant, "stats": dict(r.stats)}
        for b in batches
        for r in b.tensor_rows
    ]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    dims = [128, 256, 128, 128]
    layers: list[nn.Module] = []
    for i in range(3):
        layers += [nn.Linear(dims[i], dims[i + 1]), nn.GELU()]
    return nn.Sequential(*layers[:-1]).cuda()


def compare(recipe: str, out: Path) -> dict:
    """fp8track's capture vs TE's LogFp8TensorStats on the same layers and steps."""
    stats = ["underflows%", "mse"] + (["overflows%"] if recipe.startswith("delayed") else [])
    got: list = []
    bridge = TEStatsBridge(got.append)
    extra = {"LogFp8TensorStats": {"enabled": True, "tensors": TENSORS, "stats": stats, "freq": 1}}
    te_capture.initialize(
        te_capture.debug_config(extra_features=extra),
        statistics_logger=bridge,
        log_dir=str(out / "nv"),
        default_logging_enabled=False,
    )
    model = _mlp()
    report = apply_fp8(model, recipe, bf16_layers="last", backend="te")
    bridge.model = model
    mon = Monitor(model, MonitorConfig(every_n_steps=1), log_dir=out / "runs").attach()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(3):
        x = torch.randn(256, 128, device="cuda") * (1 + step)  # growing amax: delayed scales lag
        with report.autocast():
            y = model(x)
        loss = y.float().pow(2).mean()
        loss.backward()
        opt.step()
        mon.step(loss=loss)  # also debug_api.step(): TE's stats reach the bridge
        opt.zero_grad()
    mon.close()
    bridge.flush()
    return {
        "fp8_layers": list(report.fp8_layers),
        "bf16_layers": [n for n, _ in report.bf16_layers],
        "ours": _rows(mon.run_dir),
        "te": _bridge_rows(got),
    }


def reference(out: Path) -> dict:
    """TE's FP8 forward against the unquantised model (same weights) and fp8track's emulation."""
    import copy

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).norm() / b.float().norm())

    res = {}
    for recipe in ("delayed", "current"):
        ref = _mlp()
        te_model, em_model = copy.deepcopy(ref), copy.deepcopy(ref)
        report = apply_fp8(te_model, recipe, backend="te")
        apply_fp8(em_model, recipe, backend="emulated")
        x = torch.randn(256, 128, device="cuda")
        # Grad enabled: TE updates delayed scales at autocast exit only then (quantization.py::autocast_exit).
        y_ref = ref(x).detach()
        for _ in range(2):  # delayed scaling: the second pass uses the scales of the first
            with report.autocast():
                y_te = te_model(x).detach()
            y_em = em_model(x).detach()
        res[recipe] = {
            "te_vs_ref": rel(y_te, y_ref),
            "em_vs_ref": rel(y_em, y_ref),
            "te_vs_em": rel(y_te, y_em),
        }
    return res


def transformer_layer(out: Path) -> dict:
    """A te.TransformerLayer: rows for qkv, proj, fc1, fc2; qkv's activation (ln_out) amax vs TE's."""
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling

    got: list = []
    bridge = TEStatsBridge(got.append)
    extra = {"LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["cur_amax"], "freq": 1}}
    te_capture.initialize(
        te_capture.debug_config(extra_features=extra),
        statistics_logger=bridge,
        log_dir=str(out / "nv"),
        default_logging_enabled=False,
    )
    torch.manual_seed(0)
    layer = te.TransformerLayer(
        128, 512, 4, params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0
    )
    bridge.model = layer
    mon = Monitor(layer, MonitorConfig(every_n_steps=1), log_dir=out / "runs").attach()
    for _ in range(2):
        x = torch.randn(32, 4, 128, device="cuda", requires_grad=True)
        with te.autocast(enabled=True, recipe=DelayedScaling()):
            y = layer(x)
        y.float().pow(2).mean().backward()
        mon.step()
    mon.close()
    bridge.flush()
    return {"captures": sorted(mon.captures), "ours": _rows(mon.run_dir), "te": _bridge_rows(got)}


def native(out: Path) -> dict:
    """te.Linear layers built directly (no apply_fp8, no debug API): module hooks, lazy plan."""
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling

    torch.manual_seed(0)
    model = nn.Sequential(
        te.Linear(128, 128, params_dtype=torch.float32), te.Linear(128, 128, params_dtype=torch.float32)
    )
    used: list[float] = []
    model[0].register_forward_hook(lambda m, a, o: used.append(float(m.fp8_meta["scaling_fwd"].scale[0])))
    mon = Monitor(model, MonitorConfig(every_n_steps=1), log_dir=out / "runs").attach()
    recipe = DelayedScaling(amax_history_len=4)
    for step in range(3):
        x = torch.randn(64, 128, device="cuda") * (1 + step)
        with te.autocast(enabled=True, recipe=recipe):
            y = model(x)
        y.float().pow(2).mean().backward()
        mon.step()
    plan = mon.captures["0"].plan
    mon.close()
    return {
        "scaling": plan.scaling,
        "has_scale_fns": sorted(plan.scale_fns),
        "used": used,
        "ours": _rows(mon.run_dir),
    }


def fit(kind: str, out: Path) -> dict:
    """20 steps of Trainer.fit with FP8Monitor: fp8track's TE plugin or Lightning's own."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from fp8track.execution.backends import te as te_backend
    from fp8track.execution.recipes import Recipe
    from fp8track.lightning import FP8Monitor

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.body = nn.Sequential(
                nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.GELU(), nn.Linear(64, 32)
            )

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.body(x).float(), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            x = torch.randn(20 * 64, 64, generator=g)
            return DataLoader(TensorDataset(x, x[:, :32].clone()), batch_size=64)

    model = Net()
    if kind == "fp8track":
        recipe = Recipe("delayed", amax_history_len=16)
        model.body.cuda()
        apply_fp8(model.body, recipe, backend="te")
        plugins, precision = [te_backend.lightning_precision(recipe)], None
    else:
        plugins, precision = [], "transformer-engine"
    mon = FP8Monitor(every_n_steps=5, log_dir=out / "runs", trackers="none")
    kw = {"precision": precision} if precision else {}
    trainer = pl.Trainer(
        accelerator="cuda",
        devices=1,
        max_steps=20,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=out,
        plugins=plugins,
        callbacks=[mon],
        **kw,
    )
    trainer.fit(model)
    linears = [n for n, m in model.named_modules() if type(m).__name__ in ("Linear", "TEBF16Linear")]
    kinds = {n: type(m).__module__ for n, m in model.named_modules() if n in linears}
    run = next((out / "runs").rglob("meta.json")).parent
    return {"linears": linears, "module_kinds": kinds, "ours": _rows(run)}


CHECKS = {
    "delayed": lambda out: compare("delayed:hybrid:h4:max", out),
    "current": lambda out: compare("current:m1", out),
    "block": lambda out: compare("block", out),
    "reference": reference,
    "transformer_layer": transformer_layer,
    "native": native,
    "fit_fp8track": lambda out: fit("fp8track", out),
    "fit_lightning": lambda out: fit("lightning", out),
}


if __name__ == "__main__":
    name, out_dir = sys.argv[1], Path(sys.argv[2])
    out_dir.mkdir(parents=True, exist_ok=True)
    result = CHECKS[name](out_dir)
    (out_dir / "result.json").write_text(json.dumps(result))
