"""The monitor on compiled models, in the three forms users write: a plain loop over
``torch.compile(model)``, a LightningModule holding ``torch.compile(inner)``, and the whole
LightningModule compiled and handed to ``Trainer.fit``.

Each run is compared with the same run uncompiled: the layers monitored are the layers that ran a
GEMM, every (step, layer, tensor) has the same element count, the recorded loss is the loss the
user's code computed, and dynamo compiles nothing on an unsampled step once each state (sampled,
unsampled) has been seen. The statistics kernel still runs compiled (its own ``torch.compile``,
called from the capture's ``torch.compiler.disable`` region).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader, TensorDataset

from fp8track import Monitor, apply_fp8
from fp8track.lightning import FP8Monitor
from fp8track.monitoring.records import RunReader
from fp8track.numerics import stats

from helpers.lightning import quiet_trainer

pytestmark = pytest.mark.slow

STEPS, EVERY = 7, 3
# The Lightning forms compile the model with AOTAutograd but no inductor code generation: guards,
# hooks and graph breaks are dynamo's and the same under any backend, and CI saves two inductor
# builds of the model (the plain loop uses inductor; the statistics kernel always does).
LIGHTNING_BACKEND = "aot_eager"
SAMPLED = [s for s in range(STEPS) if s % EVERY == 0]


def _body(fp8: bool = True) -> nn.Module:
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))
    if fp8:
        apply_fp8(body, "current", backend="emulated", bf16_layers="last")  # FP8 and shadow layers
    return body


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(32, 32, generator=g) for _ in range(STEPS)]
    return [(x, x.sum(1, keepdim=True)) for x in xs]


def _name(layer: str) -> str:
    # Wrapper prefixes (OptimizedModule's ``_orig_mod``) are not part of a layer's identity.
    return ".".join(p for p in layer.split(".") if p != "_orig_mod")


def _counts(run_dir) -> dict[tuple[int, str, str, str], float]:
    return {
        (r.step, _name(r.layer), r.tensor, r.variant): r.stats["numel"]
        for r in RunReader(run_dir).tensor_stats()
    }


def _compiles() -> int:
    """Frames dynamo has compiled so far (every recompile counts)."""
    return counters["stats"]["unique_graphs"]


def _plain_loop(tmp_path, compiled: bool) -> tuple[dict, list[float], list[int]]:
    body = _body()
    model = torch.compile(body) if compiled else body
    opt = torch.optim.SGD(body.parameters(), lr=0.05)
    mon = Monitor(model, {"every_n_steps": EVERY}, log_dir=tmp_path / ("c" if compiled else "e")).attach()
    losses, compiles = [], []
    for x, y in _batches():
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        mon.step(loss=loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        compiles.append(_compiles())
    mon.close()
    assert RunReader(mon.run_dir).series() == pytest.approx(dict(enumerate(losses)), rel=1e-6)
    return _counts(mon.run_dir), losses, compiles


def _gemm_layers(body: nn.Module) -> set[str]:
    return {name for name, m in body.named_modules() if isinstance(m, nn.Linear)}


def _check_counts(compiled: dict, eager: dict, prefix: str = "") -> None:
    assert compiled == eager
    assert sorted({k[0] for k in compiled}) == SAMPLED
    assert {k[1] for k in compiled} == {
        prefix + n for n in _gemm_layers(_body())
    }  # every layer that ran a GEMM
    # 32 tokens x 32 features into the first layer, 64 x 64 weights in the middle one
    assert compiled[(0, prefix + "0", "activation", "actual")] == 32 * 32
    assert compiled[(3, prefix + "2", "weight", "actual")] == 64 * 64
    assert compiled[(6, prefix + "4", "gradient", "shadow")] == 32


def _check_no_recompiles(compiles: list[int]) -> None:
    # Steps 0 (sampled) and 1 (unsampled) compile each state once; nothing after that.
    assert compiles[1] > 0
    assert compiles[2:] == [compiles[1]] * (STEPS - 2)


def test_plain_loop_over_a_compiled_model(tmp_path):
    torch._dynamo.reset()
    counters.clear()
    eager, eager_losses, _ = _plain_loop(tmp_path, compiled=False)
    kernels_before = len(stats._POLICY.kernels)
    compiled, losses, compiles = _plain_loop(tmp_path, compiled=True)
    _check_counts(compiled, eager)
    _check_no_recompiles(compiles)
    assert losses == pytest.approx(eager_losses, rel=1e-4)
    assert stats.get_compile() == "auto" and not stats._POLICY.failed
    # The statistics run outside the model's graph: these small tensors in the monitor's grouped pass
    # per hook phase (fp8track.monitoring.stats_batch), larger ones through the compiled kernel.
    assert len(stats._POLICY.kernels) >= kernels_before


class Net(pl.LightningModule):
    def __init__(self, compile_inner: bool = False) -> None:
        super().__init__()
        self.body = _body()
        if compile_inner:
            self.body = torch.compile(self.body, backend=LIGHTNING_BACKEND)
        self.raw: dict[int, float] = {}
        self.compiles: dict[int, int] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.raw[self.global_step] = loss.item()
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.compiles[self.global_step - 1] = _compiles()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        xs, ys = zip(*_batches(), strict=True)
        return DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=32)


def _fit(tmp_path, model: pl.LightningModule, name: str) -> dict:
    mon = FP8Monitor(every_n_steps=EVERY, trackers="none", log_dir=str(tmp_path / name))
    trainer = quiet_trainer(tmp_path, [mon], max_steps=STEPS)
    inner = model._orig_mod if hasattr(model, "_orig_mod") else model
    trainer.fit(model)
    series = RunReader(mon.run_dir).series()
    assert series == pytest.approx(inner.raw, rel=1e-6)  # the loss the user's step computed
    return _counts(mon.run_dir)


def test_lightning_module_with_a_compiled_inner_module(tmp_path):
    torch._dynamo.reset()
    counters.clear()
    eager = _fit(tmp_path, Net(), "eager")
    model = Net(compile_inner=True)
    compiled = _fit(tmp_path, model, "compiled")
    _check_counts(compiled, eager, prefix="body.")
    _check_no_recompiles([model.compiles[s] for s in range(STEPS)])


def test_whole_lightning_module_compiled(tmp_path):
    torch._dynamo.reset()
    counters.clear()
    eager = _fit(tmp_path, Net(), "eager")
    model = Net()
    compiled = _fit(tmp_path, torch.compile(model, backend=LIGHTNING_BACKEND), "compiled")
    _check_counts(compiled, eager, prefix="body.")
    _check_no_recompiles([model.compiles[s] for s in range(STEPS)])


def test_model_compiled_and_run_before_attach_and_a_twin_compiled_alongside(tmp_path):
    # Dynamo reuses a graph traced without hooks for any instance of the same class unless it
    # guards on hooks: attaching turns those guards on and drops the graphs traced before.
    torch._dynamo.reset()
    # torch's default, set with torch's own patch: pytest's monkeypatch (8.4+) undoes it with a
    # delattr, which hides the option from dynamo for the rest of the process.
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=True):
        _twin_compiled_alongside(tmp_path)


def _twin_compiled_alongside(tmp_path):
    # Plain linears: the model traces into one graph (emulated FP8 layers break the graph around
    # their autograd Function, and hooks called outside a graph are always seen).
    control, monitored = _body(fp8=False), _body(fp8=False)
    c_control = torch.compile(control, backend=LIGHTNING_BACKEND)
    c_monitored = torch.compile(monitored, backend=LIGHTNING_BACKEND)
    for model in (c_control, c_monitored):
        model(torch.randn(32, 32)).sum().backward()  # the training shape: no retrace for a new shape
    mon = Monitor(c_monitored, {"every_n_steps": 2}, log_dir=tmp_path).attach()
    for x, y in _batches()[:3]:
        loss = nn.functional.mse_loss(c_monitored(x), y)
        loss.backward()
        mon.step(loss=loss)
        c_control(x).sum().backward()  # the twin, unmonitored, runs in between
    mon.close()
    counts = _counts(mon.run_dir)
    assert sorted({k[0] for k in counts}) == [0, 2]
    assert {k[1] for k in counts} == _gemm_layers(monitored)
    assert len(counts) == 2 * 3 * 3  # 2 sampled steps x 3 layers x 3 tensors
    assert all(len(m._forward_hooks) == 0 for m in control.modules())
