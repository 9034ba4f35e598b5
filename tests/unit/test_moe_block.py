"""Block-scaled recipes (MXFP8, 128-blocks) on fused experts: the grouped GEMM with per-expert group
padding, and per-expert block statistics.

References: torchao's MX quantiser (``to_mx`` with TE's rounded-up E8M0 scales, independent code)
applied to each expert's own slices; for 128-blocks the block quantiser applied to each expert's
slice alone (the grouping, padding and segment reductions are what is under test)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import fp8track
from fp8track import apply_fp8
from fp8track.execution.fp8_experts import EmulatedFP8Experts
from fp8track.execution.grouped_block import fp8_block_grouped_linear, padded_positions
from fp8track.execution.recipes import Recipe
from fp8track.numerics.formats import get_format
from fp8track.numerics.scaling import block_fake_quantize
from fp8track.numerics.segment_stats import expert_tile_partial_stats, segment_block_partial_stats
from fp8track.numerics.stats import block_partial_stats, block_quant_stats, finalize

from helpers.moe import E, H, K, batch, forward_loss, tiny_moe

OFFS = [5, 5, 41, 47]  # expert 1 empty; expert 2's 36 rows cross a 32-row block boundary


def _mx(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torchao's MXFP8 fake quantisation along the last dim (zero-padded to 32), RCEIL scales."""
    from torchao.prototype.mx_formats.mx_tensor import ScaleCalculationMode, to_dtype, to_mx

    pad = (-x.shape[-1]) % 32
    xp = torch.nn.functional.pad(x.float(), (0, pad))
    scale, data = to_mx(xp, dtype, 32, scaling_mode=ScaleCalculationMode.RCEIL)
    return to_dtype(data, scale, dtype, 32, torch.float32)[..., : x.shape[-1]]


def _groups() -> list[slice]:
    bounds = [0, *OFFS]
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _close_stats(a: dict, b: dict) -> None:
    for k, v in b.items():
        assert a[k] == pytest.approx(v, rel=1e-6, abs=1e-9) or (a[k] != a[k] and v != v), k


def _per_expert_close(y, dx, dw, ref_y, ref_dx, ref_dw) -> None:
    """Each expert against its own reference, in its own magnitude (a block mixing experts would
    crush the small expert's values, invisible next to the large one's)."""
    for e, g in enumerate(_groups()):
        for got, ref in ((y[g], ref_y[e]), (dx[g], ref_dx[e]), (dw[e], ref_dw[e])):
            if ref.numel() and ref.abs().max() > 0:
                assert torch.allclose(got, ref, rtol=2e-3, atol=2e-3 * ref.abs().max().item()), e


def test_group_padding_puts_every_group_on_a_block_boundary():
    pos, total = padded_positions(torch.tensor(OFFS, dtype=torch.int32), 47, 32)
    assert pos.tolist() == [0, 1, 2, 3, 4, *range(32, 68), *range(96, 102)]
    assert total >= 102 and total % 32 == 0


def test_mxfp8_grouped_gemm_equals_a_per_expert_torchao_reference_forward_and_backward():
    torch.manual_seed(0)
    x = torch.randn(47, 64)
    x[5:41] *= 1e5  # one expert's tokens far larger: blocks mixing experts would crush the others
    x.requires_grad_(True)
    w = (torch.randn(E, 48, 64) * 0.05).requires_grad_(True)
    offs = torch.tensor(OFFS, dtype=torch.int32)
    y = fp8_block_grouped_linear(x, w, offs, Recipe.parse("mxfp8"))
    dy = torch.randn_like(y)
    y.backward(dy)
    e4 = torch.float8_e4m3fn
    ref_y, ref_dx, ref_dw = [], [], []
    for e, g in enumerate(_groups()):
        xe, we, ge = x[g].detach(), w[e].detach(), dy[g]
        ref_y.append(_mx(xe, e4) @ _mx(we, e4).t())
        ref_dx.append(_mx(ge, e4) @ _mx(we.t(), e4).t())  # MXFP8: E4M3 everywhere (TE's recipe)
        ref_dw.append(_mx(ge.t(), e4) @ _mx(xe.t(), e4).t())  # blocks along this expert's tokens only
    _per_expert_close(y, x.grad, w.grad, ref_y, ref_dx, ref_dw)
    assert torch.equal(w.grad[1], torch.zeros(48, 64))  # the empty expert
    hp = torch.cat([x[g].detach() @ w[e].detach().t() for e, g in enumerate(_groups())])
    rel = ((y - hp).norm() / hp.norm()).item()
    assert 1e-3 < rel < 0.1  # FP8 rounding is in the output, and only rounding


def test_block128_grouped_gemm_equals_per_expert_block_quantisation():
    """DeepSeek-V3's recipe: 1x128 activations and gradients, 128x128 weight tiles of each expert."""
    torch.manual_seed(1)
    x = torch.randn(47, 160, requires_grad=True)
    w = (torch.randn(E, 130, 160) * 0.05).requires_grad_(True)  # 130 rows: a tile spills per expert
    offs = torch.tensor(OFFS, dtype=torch.int32)
    recipe = Recipe.parse("block")
    y = fp8_block_grouped_linear(x, w, offs, recipe)
    dy = torch.randn_like(y)
    y.backward(dy)
    fmt = get_format(recipe.formats.forward.name)
    bwd = get_format(recipe.formats.backward.name)

    def fq(t: torch.Tensor, layout: str, f=fmt) -> torch.Tensor:
        return block_fake_quantize(t, layout, f)[0]

    ref_y, ref_dx, ref_dw = [], [], []
    for e, g in enumerate(_groups()):
        xe, we, ge = x[g].detach(), w[e].detach(), dy[g]
        ref_y.append(fq(xe, "block128") @ fq(we, "block128x128").t())
        ref_dx.append(fq(ge, "block128", bwd) @ fq(we.t(), "block128x128").t())
        ref_dw.append(fq(ge.t(), "block128", bwd) @ fq(xe.t(), "block128").t())
    _per_expert_close(y, x.grad, w.grad, ref_y, ref_dx, ref_dw)


@pytest.mark.parametrize("layout", ["mxfp8", "block128"])
def test_segment_block_statistics_equal_each_groups_own(layout):
    torch.manual_seed(2)
    x = torch.randn(47, 70)  # 70 columns: every row's last block is padded
    x[5:41] *= 1e4
    x[44] = 0.0
    seg = torch.repeat_interleave(torch.arange(E), torch.diff(torch.tensor([0, *OFFS])))
    parts = segment_block_partial_stats(x, seg, E, layout, "e4m3")
    for e, g in enumerate(_groups()):
        if g.stop == g.start:
            assert parts[e, 0] == 0
            continue
        _close_stats(finalize(parts[e], "e4m3"), finalize(block_partial_stats(x[g], layout, "e4m3"), "e4m3"))
    w = torch.randn(3, 150, 200)
    tiles = expert_tile_partial_stats(w, "block128x128", "e4m3")
    for e in range(3):
        ref = finalize(block_partial_stats(w[e], "block128x128", "e4m3"), "e4m3")
        _close_stats(finalize(tiles[e], "e4m3"), ref)


@pytest.mark.parametrize("recipe", ["mxfp8", "block"])
def test_moe_models_run_block_recipes_on_their_experts_and_record_block_rows(tmp_path, recipe):
    model = tiny_moe("mixtral")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # converted: nothing listed, nothing to warn about
        report = apply_fp8(model, recipe, backend="emulated")
    assert not report.unconverted and "model.layers.0.mlp.experts" in report.fp8_layers
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, EmulatedFP8Experts)
    routed: list[torch.Tensor] = []
    gate = model.model.layers[0].mlp.gate
    gate.register_forward_hook(lambda m, a, out: routed.append(out[2].detach()))
    hidden: list[torch.Tensor] = []
    model.model.layers[0].mlp.register_forward_pre_hook(lambda m, a: hidden.append(a[0].detach()))
    with fp8track.Monitor(model, fp8track.MonitorConfig(every_n_steps=1), log_dir=tmp_path,
                          apply_report=report) as mon:
        loss = forward_loss(model, "mixtral", batch(0))
        loss.backward()
        mon.step(loss=loss)
    assert torch.isfinite(loss) and experts.gate_up_proj.grad is not None
    rows = {(r["layer"], r["tensor"]): r["stats"]
            for r in map(json.loads, (mon.run_dir / "tensor_stats.jsonl").read_text().splitlines())}
    fmt = Recipe.parse(recipe).formats.forward.name
    layout = "mxfp8" if recipe == "mxfp8" else "block128"
    h = hidden[0].reshape(-1, H)
    idx = routed[0].reshape(-1, K)
    for e in range(E):
        tok = torch.where((idx == e).any(-1))[0]
        got = rows.get((f"model.layers.0.mlp.experts.gate_up_proj.expert_{e}", "activation"))
        if tok.numel() == 0:
            assert got is None
            continue
        _close_stats({k: got[k] for k in ("sqnr_db", "underflow_pct", "amax", "scale")},
                     {k: v for k, v in block_quant_stats(h[tok], layout, fmt).items()
                      if k in ("sqnr_db", "underflow_pct", "amax", "scale")})
        w_layout = "mxfp8" if recipe == "mxfp8" else "block128x128"
        w_row = rows[(f"model.layers.0.mlp.experts.down_proj.expert_{e}", "weight")]
        w_ref = block_quant_stats(experts.down_proj[e].detach(), w_layout, fmt)
        _close_stats({"sqnr_db": w_row["sqnr_db"]}, {"sqnr_db": w_ref["sqnr_db"]})
