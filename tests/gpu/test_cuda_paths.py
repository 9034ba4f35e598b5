"""fp8track's CUDA paths without Transformer Engine: the compiled statistics kernel, torchao's real
FP8 GEMMs, the monitor and the Lightning callback on a GPU.

On a GPU (`make test-gpu`, `bash bench/gpu_session.sh`) everything runs on CUDA. Without one the
same tests run on CPU tensors as part of the ordinary suite: a dry run of the code paths (torchao
then emulates its FP8 GEMM, so the comparison with the emulated backend is tighter there).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fp8track import Monitor, MonitorConfig
from fp8track.execution.apply import apply_fp8
from fp8track.execution.backends import fp8_format_for
from fp8track.monitoring.records import RunReader
from fp8track.numerics import stats

pytestmark = [pytest.mark.gpu]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _tensors() -> dict[str, torch.Tensor]:
    """Distributions that exercise every statistic: wide ranges, zeros, subnormal scale, non-finite."""
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(512, 384, generator=g) * torch.logspace(-6, 4, 384)
    tiny = torch.randn(300, 77, generator=g) * 1e-9  # odd shape: rows that do not fill a block
    sparse = torch.randn(256, 256, generator=g) * (torch.rand(256, 256, generator=g) < 0.1)
    bad = torch.randn(128, 64, generator=g)
    bad[3, 5], bad[7, 1], bad[9, 9] = float("nan"), float("inf"), -float("inf")
    return {"wide": wide, "tiny": tiny, "sparse": sparse, "nonfinite": bad}


@pytest.mark.skipif(
    DEVICE.type == "cpu", reason="compares the CUDA kernel with the CPU one; on CPU it would compare the "
    "CPU kernel with itself (tests/unit/test_stats.py checks it against the independent references)"
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_device_statistics_equal_the_cpu_reference(dtype, fmt):
    """The kernel compiled for the device gives the CPU kernel's statistics: counts exactly, sums to
    float32 reduction-order rounding.
    Long on CPU (about 50 s for the first dtype): inductor compiles the kernel per shape class and dtype."""
    for name, x in _tensors().items():
        x = x.to(dtype)
        ref = stats.quant_stats(x, fmt)
        got = stats.quant_stats(x.to(DEVICE), fmt)
        assert set(got) == set(ref)
        for key, r in ref.items():
            v = got[key]
            if key in ("numel", "nonfinite_pct", "underflow_pct", "overflow_pct", "zero_pct"):
                assert v == pytest.approx(r, rel=0, abs=1e-9), (name, key)
            elif math.isnan(r):
                assert math.isnan(v), (name, key)
            else:
                assert v == pytest.approx(r, rel=1e-5, abs=1e-30), (name, key, v, r)


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    # Every dimension a multiple of 16: what FP8 GEMMs on the device require.
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32), nn.GELU(), nn.Linear(32, 16))


def test_emulated_backend_matches_torchao_real_fp8_gemms():
    """Current scaling, same quantised operands: our emulated layers (``torch._scaled_mm`` on the
    device) and torchao's ``Float8Linear`` (its real FP8 GEMM on CUDA) give the same outputs and
    gradients up to accumulation order, and differ from the unquantised model."""
    pytest.importorskip("torchao.float8")
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    ours, theirs, plain = (_mlp().to(DEVICE, dtype) for _ in range(3))
    apply_fp8(ours, "current", backend="emulated")
    apply_fp8(theirs, "current", backend="torchao")
    assert type(theirs[0]).__name__ == "Float8Linear"
    assert theirs[0].config.emulate is (DEVICE.type != "cuda")
    x = torch.randn(64, 64, device=DEVICE, dtype=dtype)
    y1, y2, y0 = ours(x), theirs(x), plain(x)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert torch.allclose(y1.float(), y2.float(), rtol=tol, atol=tol * y2.abs().max().item())
    assert not torch.allclose(y1.float(), y0.float(), rtol=1e-3, atol=1e-4)
    y1.float().square().mean().backward()
    y2.float().square().mean().backward()
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        scale = b.grad.abs().max().item()
        assert torch.allclose(a.grad.float(), b.grad.float(), rtol=5e-2, atol=5e-2 * scale)


def test_monitor_on_a_torchao_model_records_what_the_reference_computes(tmp_path):
    """Monitor on torchao layers on the device: every FP8 layer x tensor on the sampled steps, and
    the first layer's activation statistics equal the CPU reference of the same input."""
    pytest.importorskip("torchao.float8")
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    model = _mlp().to(DEVICE, dtype)
    report = apply_fp8(model, "current", backend="torchao")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = Monitor(model, MonitorConfig(every_n_steps=2), log_dir=tmp_path).attach()
    inputs = {}
    for step in range(5):
        x = torch.randn(32, 64, device=DEVICE, dtype=dtype)
        inputs[step] = x
        loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        mon.step(loss=loss)
        opt.zero_grad(set_to_none=True)
    mon.close()
    rows = list(RunReader(mon.run_dir).tensor_stats())
    assert sorted({r.step for r in rows}) == [0, 2, 4]
    expected = {
        (s, layer, t)
        for s in (0, 2, 4)
        for layer in report.fp8_layers
        for t in ("activation", "weight", "gradient")
    }
    assert {(r.step, r.layer, r.tensor) for r in rows} == expected
    assert {r.variant for r in rows} == {"actual"}
    row = next(r for r in rows if r.step == 2 and r.layer == "0" and r.tensor == "activation")
    ref = stats.quant_stats(inputs[2].cpu(), "e4m3")
    for key in ("amax", "amin", "underflow_pct", "overflow_pct", "mse", "cos", "numel"):
        assert row.stats[key] == pytest.approx(ref[key], rel=1e-5), key
    grad = next(r for r in rows if r.step == 4 and r.layer == "2" and r.tensor == "gradient")
    # TE's default current-scaling recipe is HYBRID: gradients in E5M2 (max 57344).
    assert fp8_format_for(model[2], "gradient") == "e5m2"
    assert grad.stats["current_scale"] == pytest.approx(57344 / grad.stats["amax"], rel=1e-6)


def test_lightning_callback_on_the_device(tmp_path):
    """FP8Monitor in a real Trainer on the device (bf16-mixed), torchao FP8 layers: records land on
    the sampled steps and the loss series is complete."""
    pytest.importorskip("torchao.float8")
    import lightning as L

    from fp8track import FP8Monitor
    from fp8track.examples.gpt import GPTConfig
    from fp8track.examples.gpt_lightning import GPTLightningModule

    torch.manual_seed(0)
    module = GPTLightningModule(GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=32)).to(DEVICE)
    report = apply_fp8(module, "current", backend="torchao")
    cfg = module.model.config
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, cfg.vocab, (16 * 8, cfg.block_size + 1), generator=g)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(data[:, :-1], data[:, 1:]), batch_size=16
    )
    monitor = FP8Monitor(every_n_steps=3, log_dir=tmp_path)
    trainer = L.Trainer(
        accelerator="gpu" if DEVICE.type == "cuda" else "cpu", devices=1, precision="bf16-mixed",
        max_steps=7, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[monitor],
    )
    trainer.fit(module, loader)
    reader = RunReader(monitor.run_dir)
    assert len(reader.series("fp8/loss")) == 7
    rows = list(reader.tensor_stats())
    assert sorted({r.step for r in rows}) == [0, 3, 6]
    # records carry canonical names: the LightningModule's `model.` holder dropped
    assert {r.layer for r in rows} == {n.removeprefix("model.") for n in report.fp8_layers}
    assert all(math.isfinite(r.stats["mse"]) and r.stats["numel"] > 0 for r in rows)
