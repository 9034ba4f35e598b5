"""Emulated FP8 linear: hand-worked delayed scaling, independent references for every recipe."""

import pytest
import torch
from torch import nn

from fp8track.errors import ConfigError
from fp8track.execution.apply import apply_fp8
from fp8track.execution.backends import fp8_format_for, is_fp8_linear, used_scales
from fp8track.execution.emulated_linear import EmulatedFP8Linear
from fp8track.execution.recipes import Recipe


def make(recipe, in_f=32, out_f=16, bias=True, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(in_f, out_f, bias=bias)
    return lin, EmulatedFP8Linear.from_linear(lin, Recipe.parse(recipe))


def ref_q(x, scale, dtype, fmax):
    """Independent per-tensor quantise-dequantise in float64 (clamp then cast)."""
    scale = float(scale.detach()) if torch.is_tensor(scale) else float(scale)
    q = (x.double() * scale).clamp(-fmax, fmax).float().to(dtype)
    return q.double() / float(scale)


def x_with_amax(a, shape=(4, 32), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(shape, generator=g) * 0.5 * a
    x[0, 0] = a
    return x


def test_delayed_scaling_hand_worked_history_and_scales():
    # history_len 3, algo max, e4m3 (448). Amax per step: 2, 4, 1, 1, 1, 1.
    # Step: used scale | history after observe | new scale | history after roll+zero
    #  1    1          | [2,0,0]               | 448/2=224 | [0,0,2]
    #  2    224        | [4,0,2]               | 448/4=112 | [0,2,4]
    #  3    112        | [1,2,4]               | 112       | [0,4,1]
    #  4    112        | [1,4,1]               | 112       | [0,1,1]
    #  5    112        | [1,1,1]               | 448       | [0,1,1]
    #  6    448
    _, layer = make("delayed:hybrid:h3:max", bias=False)
    used, hist = [], []
    for a in (2.0, 4.0, 1.0, 1.0, 1.0, 1.0):
        layer(x_with_amax(a))
        used.append(float(layer.fp8_scales()["activation"]))
        hist.append(layer.delayed_scalers["activation"].amax_history.tolist())
    assert used == [1.0, 224.0, 112.0, 112.0, 112.0, 448.0]
    assert hist[:5] == [[0, 0, 2], [0, 2, 4], [0, 4, 1], [0, 1, 1], [0, 1, 1]]


def test_delayed_most_recent_and_margin():
    _, layer = make("delayed:e4m3:h3:most_recent:m1", bias=False)
    used = []
    for a in (2.0, 4.0, 1.0, 1.0):
        layer(x_with_amax(a))
        used.append(float(layer.fp8_scales()["activation"]))
    # scale = 448 / amax / 2**1, from the most recent amax only.
    assert used == [1.0, 112.0, 56.0, 224.0]


def test_delayed_eval_uses_but_does_not_update_and_state_round_trips():
    _, layer = make("delayed:hybrid:h4:max")
    layer(x_with_amax(2.0))
    scale = float(layer.delayed_scalers["activation"].scale)
    layer.eval()
    layer(x_with_amax(8.0))
    assert float(layer.fp8_scales()["activation"]) == scale == 224.0
    assert float(layer.delayed_scalers["activation"].scale) == scale
    _, fresh = make("delayed:hybrid:h4:max")
    fresh.load_state_dict(layer.state_dict())
    assert torch.equal(
        fresh.delayed_scalers["activation"].amax_history, layer.delayed_scalers["activation"].amax_history
    )
    assert float(fresh.delayed_scalers["activation"].scale) == 224.0


@pytest.mark.parametrize(
    "shape", [(8, 32, 16), (5, 24, 40)]
)  # second: not multiples of 16 -> dequantised GEMM
@pytest.mark.parametrize("recipe", ["current", "fp8_input_bf16_gemm", "current:e4m3"])
def test_per_tensor_forward_and_backward_match_independent_reference(recipe, shape):
    m, k, n = shape
    lin, layer = make(recipe, k, n)
    r = Recipe.parse(recipe)
    x = torch.randn(m, k, requires_grad=True)
    y = layer(x)
    g = torch.randn(m, n) * 1e-3
    y.backward(g)

    e4, gdt = torch.float8_e4m3fn, (torch.float8_e5m2 if r.fp8_format == "hybrid" else torch.float8_e4m3fn)
    gmax = 57344.0 if r.fp8_format == "hybrid" else 448.0
    sx, sw, sg = 448 / x.abs().max(), 448 / lin.weight.abs().max(), gmax / g.abs().max()
    xd, wd, gd = (
        ref_q(x.detach(), sx, e4, 448),
        ref_q(lin.weight.detach(), sw, e4, 448),
        ref_q(g, sg, gdt, gmax),
    )
    y_ref = xd @ wd.t() + lin.bias.double()
    scales = layer.fp8_scales()
    assert torch.allclose(scales["activation"].double(), sx.double()) and torch.allclose(
        scales["gradient"].double(), sg.double()
    )
    # bf16 GEMM mode rounds dequantised operands to bf16 (relative 2**-8);
    # the FP8 GEMM accumulates in float32.
    tol = 2e-2 if r.gemm_mode == "bf16" else 1e-5
    assert torch.allclose(y.double(), y_ref, rtol=tol, atol=tol * y_ref.abs().max().item())
    gx_ref, gw_ref = gd @ wd, gd.t() @ xd
    assert torch.allclose(x.grad.double(), gx_ref, rtol=tol, atol=tol * gx_ref.abs().max().item())
    assert torch.allclose(lin.weight.grad.double(), gw_ref, rtol=tol, atol=tol * gw_ref.abs().max().item())
    assert torch.allclose(lin.bias.grad, g.sum(0))  # dbias from the high-precision dY
    # The reference must differ from the unquantised result, or this test proves nothing.
    assert not torch.allclose(gw_ref, g.double().t() @ x.detach().double(), rtol=1e-3)


def ref_block_dequant(x2d, block, fmt_dtype, fmax, mx):
    """Loop-over-blocks reference (1 x block along dim 1)."""
    out = torch.empty_like(x2d, dtype=torch.float64)
    for i in range(x2d.shape[0]):
        for j in range(0, x2d.shape[1], block):
            blk = x2d[i, j : j + block].double()
            a = blk.abs().max().item()
            if a == 0:
                out[i, j : j + block] = 0
                continue
            if mx:  # scale_inv = 2**ceil(log2(amax / fmax))
                e = torch.ceil(torch.log2(torch.tensor(a / fmax, dtype=torch.float64))).item()
                s = 2.0 ** (-e)
            else:  # scale = 2**floor(log2(fmax / amax))
                s = 2.0 ** torch.floor(torch.log2(torch.tensor(fmax / a, dtype=torch.float64))).item()
            q = (blk * s).clamp(-fmax, fmax).float().to(fmt_dtype).double()
            out[i, j : j + block] = q / s
    return out


def test_mxfp8_forward_and_backward_against_block_loop_reference():
    lin, layer = make("mxfp8", 64, 32)
    x = torch.randn(16, 64, requires_grad=True) * torch.logspace(-3, 2, 64)
    x.retain_grad()
    y = layer(x)
    g = torch.randn(16, 32) * 1e-2
    y.backward(g)
    e4 = torch.float8_e4m3fn
    xd = ref_block_dequant(x.detach(), 32, e4, 448, True)
    wd = ref_block_dequant(lin.weight.detach(), 32, e4, 448, True)
    y_ref = xd @ wd.t() + lin.bias.double()
    assert torch.allclose(y.double(), y_ref, rtol=1e-2, atol=1e-2 * y_ref.abs().max().item())
    # dgrad: dY blocks along N, W blocks along N (column-wise); wgrad: dY, x blocks along M.
    # TE's MXFP8BlockScaling defaults to E4M3 for every tensor, gradients included.
    gx_ref = (
        ref_block_dequant(g, 32, e4, 448, True)
        @ ref_block_dequant(lin.weight.detach().t(), 32, e4, 448, True).t()
    )
    gw_ref = (
        ref_block_dequant(g.t(), 32, e4, 448, True) @ ref_block_dequant(x.detach().t(), 32, e4, 448, True).t()
    )
    assert torch.allclose(x.grad.double(), gx_ref, rtol=1e-2, atol=1e-2 * gx_ref.abs().max().item())
    assert torch.allclose(lin.weight.grad.double(), gw_ref, rtol=1e-2, atol=1e-2 * gw_ref.abs().max().item())
    s = layer.fp8_scales()
    assert (
        s["activation"].shape == (16, 2) and s["weight"].shape == (32, 2) and s["gradient"].shape == (16, 1)
    )
    assert torch.all(
        torch.log2(s["activation"]) == torch.round(torch.log2(s["activation"]))
    )  # E8M0: powers of two


def test_block128_uses_rows_for_activation_and_tiles_for_weight():
    lin, layer = make("block", 256, 144)
    x = torch.randn(8, 256) * torch.logspace(-2, 2, 256)
    y = layer(x)
    s = layer.fp8_scales()
    assert s["activation"].shape == (8, 2) and s["weight"].shape == (2, 2)  # 144 rows -> 2 row tiles
    w = lin.weight.detach()
    # Weight tile (0, 0) scale: power of two <= 448 / tile amax.
    a = w[:128, :128].abs().max().item()
    assert float(s["weight"][0, 0]) == 2.0 ** torch.floor(torch.log2(torch.tensor(448.0 / a))).item()
    xd = ref_block_dequant(x, 128, torch.float8_e4m3fn, 448, False)
    wd = torch.empty_like(w, dtype=torch.float64)
    for i in range(0, w.shape[0], 128):
        for j in range(0, w.shape[1], 128):
            tile = w[i : i + 128, j : j + 128].double()
            sc = 2.0 ** torch.floor(torch.log2(448.0 / tile.abs().max())).item()
            wd[i : i + 128, j : j + 128] = (tile * sc).float().to(torch.float8_e4m3fn).double() / sc
    y_ref = xd @ wd.t() + lin.bias.double()
    assert torch.allclose(y.double(), y_ref, rtol=1e-2, atol=1e-2 * y_ref.abs().max().item())
    assert not torch.allclose(wd, w.double(), rtol=1e-3)


def test_gradient_scale_is_set_when_full_backward_hook_fires():
    _, layer = make("current")
    seen = {}
    layer.register_full_backward_hook(lambda mod, gi, go: seen.update(mod.fp8_scales()) or None)
    x = torch.randn(4, 32, requires_grad=True)
    g = torch.randn(4, 16) * 3.0
    layer(x).backward(g)
    assert float(seen["gradient"]) == pytest.approx(57344.0 / g.abs().max().item(), rel=1e-6)
    assert seen["gradient"].dim() == 0 and seen["gradient"].dtype == torch.float32


def test_bf16_recipe_is_plain_linear_and_interface_functions():
    lin, layer = make("bf16")
    x = torch.randn(4, 32)
    assert torch.equal(layer(x), lin(x))
    assert layer.fp8_scales() == {} and not is_fp8_linear(layer) and used_scales(layer) is None
    _, fp8 = make("delayed")
    assert is_fp8_linear(fp8) and not is_fp8_linear(lin)
    assert fp8_format_for(fp8, "activation") == "e4m3" and fp8_format_for(fp8, "gradient") == "e5m2"
    assert fp8_format_for(make("current:e4m3")[1], "gradient") == "e4m3"
    with pytest.raises(ConfigError):
        fp8_format_for(lin, "weight")
    with pytest.raises(ConfigError, match="valid values"):
        fp8_format_for(fp8, "bias")


def test_autocast_output_dtype_and_parameter_identity():
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    params = list(model.parameters())
    report = apply_fp8(model, "current", backend="emulated")
    assert (
        report.fp8_layers == ("0", "2")
        and [p is q for p, q in zip(params, model.parameters(), strict=True)] == [True] * 4
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(torch.randn(2, 32)).dtype == torch.bfloat16
    assert model(torch.randn(2, 32)).dtype == torch.float32
    with pytest.raises(ConfigError, match="already holds FP8 layers"):
        apply_fp8(model, "current", backend="emulated")
    with pytest.raises(ConfigError, match="valid values are: 'auto', 'emulated'"):
        apply_fp8(nn.Sequential(nn.Linear(4, 4)), "current", backend="cuda")


def test_apply_report_bf16_control_and_fallback_reasons():
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    report = apply_fp8(model, "bf16", bf16_layers="last", backend="emulated")
    assert report.fp8_layers == () and report.bf16_layers == (("0", "recipe bf16"), ("2", "last:1"))
    assert isinstance(model[0], EmulatedFP8Linear) and type(model[2]) is nn.Linear
    d = report.to_dict()
    assert d["recipe"]["name"] == "bf16" and d["backend"] == "emulated"


def test_backend_selection_without_gpu():
    from fp8track.execution.backends import resolve_backend
    from fp8track.execution.backends import te as te_backend

    if te_backend.available():
        pytest.skip("this test covers machines without Transformer Engine")
    assert resolve_backend("auto") == "emulated"
    with pytest.raises(ConfigError, match="Transformer Engine"):
        apply_fp8(nn.Sequential(nn.Linear(16, 16)), "delayed", backend="te")
    with pytest.raises(ConfigError, match="no 'FP8 input, BF16 GEMM' recipe"):
        te_backend.to_te_recipe(Recipe("fp8_input_bf16_gemm"))
