"""Emulated current scaling against torchao's tensorwise float8 (real torchao, emulate=True on CPU).

Quantised bytes and scales agree bit for bit: torchao computes ``fmax / amax`` in float64 then
rounds to float32; float32 division is correctly rounded and float64 carries more than 2*24+2
bits, so the double rounding is innocuous and both give the same float32 scale. The one documented
difference: an all-zero tensor (amax 0) gets scale 1.0 here (TE keeps its previous scale) and
``448 / 1e-12`` in torchao; the FP8 data is zero either way.
"""

import pytest
import torch
from torch import nn

pytest.importorskip("torchao.float8")
from torchao.float8.config import ScalingGranularity  # noqa: E402
from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated  # noqa: E402

from fp8track.errors import ConfigError  # noqa: E402
from fp8track.execution.apply import apply_fp8  # noqa: E402
from fp8track.execution.backends import fp8_format_for, is_fp8_linear, used_scales  # noqa: E402
from fp8track.numerics.scaling import amax, current_scale, quantize  # noqa: E402


def torchao_quantize(x, dtype):
    scale = tensor_to_scale(x, dtype, scaling_granularity=ScalingGranularity.TENSORWISE)
    return to_fp8_saturated(x.to(torch.float32) * scale, dtype), scale


@pytest.mark.parametrize("fmt, dtype", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16])
def test_quantised_bytes_and_scale_identical(fmt, dtype, src):
    torch.manual_seed(0)
    for spread in (1e-4, 1.0, 3e3):
        x = (torch.randn(64, 96) * torch.logspace(-3, 3, 96) * spread).to(src)
        s = current_scale(amax(x), fmt)
        q = quantize(x, fmt, s)
        q_ao, s_ao = torchao_quantize(x, dtype)
        assert s.dtype == s_ao.dtype == torch.float32 and torch.equal(s, s_ao.reshape(()))
        assert torch.equal(q.view(torch.uint8), q_ao.view(torch.uint8))


def test_all_zero_tensor_documented_difference():
    x = torch.zeros(4, 16)
    s = current_scale(amax(x), "e4m3")
    q_ao, s_ao = torchao_quantize(x, torch.float8_e4m3fn)
    assert float(s) == 1.0 and float(s_ao) == pytest.approx(448e12, rel=1e-6)
    assert torch.equal(quantize(x, "e4m3", s).view(torch.uint8), q_ao.view(torch.uint8))


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32), nn.GELU(), nn.Linear(32, 16))


def test_emulated_linear_matches_torchao_float8_linear_end_to_end():
    """Same quantised operands; only GEMM accumulation differs (torchao emulate: float32 mm of
    dequantised operands; emulated fp8 mode: torch._scaled_mm), so outputs agree to float32 rounding."""
    ours, theirs = mlp(), mlp()
    r1 = apply_fp8(ours, "current", bf16_layers="re:^4$", backend="emulated")
    r2 = apply_fp8(theirs, "current", bf16_layers="re:^4$", backend="torchao")
    assert r1.fp8_layers == r2.fp8_layers == ("0", "2")
    assert type(theirs[0]).__name__ == "Float8Linear" and type(theirs[4]) is nn.Linear
    assert is_fp8_linear(theirs[0]) and used_scales(theirs[0]) is None
    assert fp8_format_for(theirs[0], "gradient") == "e5m2" and fp8_format_for(theirs[0], "weight") == "e4m3"
    x = torch.randn(32, 64)
    y1, y2 = ours(x), theirs(x)
    assert torch.allclose(y1, y2, rtol=1e-4, atol=1e-5)
    y1.square().mean().backward()
    y2.square().mean().backward()
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=1e-3, atol=1e-3 * b.grad.abs().max().item())
    # Not trivially equal to the unquantised model.
    assert not torch.allclose(y1, mlp()(x), rtol=1e-4, atol=1e-5)


def test_torchao_backend_refuses_what_it_cannot_do():
    for recipe, message in [
        ("delayed", "torchao does not offer delayed scaling"),
        ("mxfp8", "not part of torchao's float8 training API"),
        ("block", "not part of torchao's float8 training API"),
        ("current:m1", "no scaling margin"),
    ]:
        with pytest.raises(ConfigError, match=message):
            apply_fp8(mlp(), recipe, backend="torchao")


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp", "current:e4m3", "fp8_input_bf16_gemm"])
def test_torchao_variants_run_on_cpu(recipe):
    model = mlp()
    report = apply_fp8(model, recipe, backend="torchao")
    assert report.fp8_layers == ("0", "2", "4")
    assert model[0].config.emulate is True
    expected_grad = "e5m2" if recipe == "fp8_input_bf16_gemm" else "e4m3"
    assert fp8_format_for(model[0], "gradient") == expected_grad
    model(torch.randn(16, 64)).sum().backward()
    assert torch.isfinite(model[0].weight.grad).all()
