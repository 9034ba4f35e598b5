"""Transformer Engine backend on a GPU: `make test-gpu` (= `pytest -m gpu tests/gpu`).

Skipped where CUDA or a working Transformer Engine is missing.
"""

import pytest
import torch
from torch import nn

from fp8track.execution.backends import fp8_format_for, is_fp8_linear, used_scales
from fp8track.execution.backends import te as te_backend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not te_backend.available(), reason="needs CUDA and Transformer Engine"),
]


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.GELU(), nn.Linear(64, 16)).cuda()


def test_delayed_scaling_scales_are_read_from_fp8_meta():
    from fp8track.execution.apply import apply_fp8

    m = model()
    report = apply_fp8(m, "delayed:hybrid:h4:max", bf16_layers="last", backend="te")
    assert report.fp8_layers == ("0", "2") and report.bf16_layers == (("4", "last:1"),)
    assert is_fp8_linear(m[0]) and not is_fp8_linear(m[4])
    assert fp8_format_for(m[0], "gradient") == "e5m2"
    seen = {}
    m[0].register_full_backward_hook(lambda mod, gi, go: seen.update(used_scales(mod)) or None)
    x = torch.randn(32, 64, device="cuda")
    for _ in range(3):
        with report.autocast():
            y = m(x)
        y.float().square().mean().backward()
    scales = used_scales(m[0])
    assert set(scales) == {"activation", "weight", "gradient"}
    # After a few steps the activation scale is 448 / amax(x) (history max, margin 0).
    assert float(scales["activation"]) == pytest.approx(448.0 / x.abs().max().item(), rel=1e-3)
    assert set(seen) == {"activation", "weight", "gradient"}


@pytest.mark.parametrize("recipe", ["current", "mxfp8", "block"])
def test_other_recipes_run_and_keep_fallback_in_bf16(recipe):
    from fp8track.execution.apply import apply_fp8

    m = model()
    report = apply_fp8(m, recipe, bf16_layers="first", backend="te")
    assert report.bf16_layers == (("0", "first:1"),)
    x = torch.randn(32, 64, device="cuda")
    try:
        with report.autocast():
            y = m(x)
    except (RuntimeError, AssertionError) as exc:  # recipe not supported on this GPU generation
        pytest.skip(f"{recipe} not supported here: {exc}")
    y.float().sum().backward()
    assert used_scales(m[2]) is None  # only delayed scaling keeps scales in fp8_meta
    assert torch.isfinite(m[2].weight.grad).all()


def test_emulated_matches_te_current_scaling_forward():
    from fp8track.execution.apply import apply_fp8

    ref, ours = model(), model()
    r_te = apply_fp8(ref, "current", backend="te")
    apply_fp8(ours, "current", backend="emulated")
    x = torch.randn(32, 64, device="cuda")
    with r_te.autocast():
        y_te = ref(x)
    y_em = ours(x)
    assert torch.allclose(y_te.float(), y_em.float(), rtol=2e-2, atol=2e-2)


def test_lightning_precision_plugin_builds():
    from fp8track.execution.recipes import Recipe

    plugin = te_backend.lightning_precision(Recipe("delayed", amax_history_len=16))
    assert type(plugin.recipe).__name__ == "DelayedScaling"
