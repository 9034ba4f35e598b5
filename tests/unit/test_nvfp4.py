"""NVFP4 quantiser (fp8track.numerics.nvfp4) against hand-worked values from TE's definition
(quantization_ref_nvfp4.py) and against torchao's NVFP4 prototype on CPU."""

from __future__ import annotations

import math

import pytest
import torch

from fp8track.numerics.nvfp4 import (
    RHT_SIGNS,
    NVFP4Options,
    columnwise_operand,
    global_encode_scale,
    hadamard_matrix,
    max_blockwise_dynamic_range,
    nvfp4_quantize,
    random_hadamard_transform,
    round_e2m1,
)
from fp8track.numerics.stats import nvfp4_partial_stats, nvfp4_quant_stats


def _te_threshold_cast(v: torch.Tensor) -> torch.Tensor:
    """TE's ``cast_to_fp4x2`` written as its threshold table (the independent reference)."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    a = v.abs()
    idx = torch.zeros_like(a, dtype=torch.long)
    # (lower bound, inclusive?) per code 1..7, from cast_to_fp4x2.
    bounds = [
        (0.25, False),
        (0.75, True),
        (1.25, False),
        (1.75, True),
        (2.5, False),
        (3.5, True),
        (5.0, False),
    ]
    for code, (b, inclusive) in enumerate(bounds, start=1):
        idx = torch.where(a >= b if inclusive else a > b, code, idx)
    return torch.copysign(grid[idx], v)


@pytest.mark.parametrize(
    ("v", "want"),
    [
        (0.1, 0.0), (0.25, 0.0), (0.2500001, 0.5), (0.75, 1.0), (0.7499, 0.5), (1.25, 1.0),
        (1.2501, 1.5), (1.75, 2.0), (2.5, 2.0), (2.5001, 3.0), (3.5, 4.0), (3.4999, 3.0),
        (5.0, 4.0), (5.0001, 6.0), (6.0, 6.0), (-0.75, -1.0), (-5.0, -4.0), (-2.5, -2.0),
    ],
)
def test_round_to_nearest_even_every_tie(v: float, want: float) -> None:
    got = round_e2m1(torch.tensor([v]))
    assert got.item() == want
    assert _te_threshold_cast(torch.tensor([v])).item() == want


def test_round_matches_te_thresholds_on_a_dense_sweep() -> None:
    v = torch.linspace(-6, 6, 200_001)
    assert torch.equal(round_e2m1(v), _te_threshold_cast(v))


def test_stochastic_rounding_neighbours_unbiased_and_seeded() -> None:
    v = torch.full((200_000,), 2.25)
    g = torch.Generator().manual_seed(7)
    r = round_e2m1(v, g, stochastic=True)
    assert set(r.unique().tolist()) == {2.0, 3.0}
    assert abs(r.mean().item() - 2.25) < 0.005  # P(up) = 0.25
    again = round_e2m1(v, torch.Generator().manual_seed(7), stochastic=True)
    assert torch.equal(r, again)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -4.0, -0.5])
    assert torch.equal(round_e2m1(grid, g, stochastic=True), grid)  # grid points never move
    r = round_e2m1(torch.full((100_000,), -4.5), g, stochastic=True)
    assert set(r.unique().tolist()) == {-4.0, -6.0} and abs(r.mean().item() + 4.5) < 0.01


def test_two_level_scales_hand_worked() -> None:
    # Block 0: amax 12 = tensor amax -> S_enc = 2688/12 = 224, s_b = 12*224/6 = 448, e_b = 0.5.
    # Block 1: amax 1.2 -> s_b = E4M3(44.8) = 44, e_b = 224/44, 1.2*e_b = 6.109 > 6: clipped to 6.
    b0 = [12.0, 3.0, 0.75, 0.1] + [0.0] * 12
    b1 = [1.2, -0.3] + [0.0] * 14
    x = torch.tensor([b0 + b1])
    q = nvfp4_quantize(x)
    assert q.global_amax.item() == 12.0
    assert global_encode_scale(q.global_amax).item() == pytest.approx(224.0, rel=1e-7)
    assert q.decode_scales.tolist() == [[448.0, 44.0]]
    assert q.encode_scales[0, 0].item() == pytest.approx(0.5, rel=1e-6)
    # 12*0.5=6 -> 6; 3*0.5=1.5; 0.75*0.5=0.375 -> 0.5; 0.1*0.5=0.05 -> 0
    assert q.codes[0, :4].tolist() == [6.0, 1.5, 0.5, 0.0]
    # -0.3 * 224/44 = -1.527 -> -1.5
    assert q.codes[0, 16:18].tolist() == [6.0, -1.5]
    assert q.clipped.item() == 1
    d = q.dequantized[0]
    assert d[:4].tolist() == pytest.approx([12.0, 3.0, 1.0, 0.0], rel=1e-6)
    assert d[16].item() == pytest.approx(6 * 44 * 12 / 2688, rel=1e-6)
    s = nvfp4_quant_stats(x)
    assert s["underflow_pct"] == pytest.approx(100 * 1 / 32)  # 0.1 became 0
    assert s["overflow_pct"] == pytest.approx(100 * 1 / 32)
    err = ((x[0] - q.dequantized[0]) ** 2).sum().item()
    assert s["mse"] == pytest.approx(err / 32, rel=1e-6)
    assert s["scale"] == pytest.approx(0.5, rel=1e-6)  # smallest encode scale: the amax block's
    assert s["current_scale"] == pytest.approx(0.5, rel=1e-6)  # 6 / amax


def test_edge_cases_zero_nonfinite_and_scale_underflow() -> None:
    z = nvfp4_quantize(torch.zeros(3, 20))
    assert torch.equal(z.dequantized, torch.zeros(3, 20)) and z.global_amax.item() == 0
    s = nvfp4_quant_stats(torch.zeros(3, 20))
    assert s["mse"] == 0 and s["underflow_pct"] == 0 and s["cos"] == 1.0
    x = torch.tensor([[float("inf"), 2.0, float("nan"), -1.0] + [0.0] * 12])
    q = nvfp4_quantize(x)
    assert q.global_amax.item() == 2.0 and torch.isfinite(q.dequantized).all()
    st = nvfp4_quant_stats(x)
    assert st["nonfinite_pct"] == pytest.approx(100 * 2 / 16) and st["numel"] == 16
    # E4M3 block scale underflow: block amax 1e-4 under tensor amax 2688 -> s_b = E4M3(1.7e-5) = 0.
    x = torch.tensor([[2688.0] + [0.0] * 15 + [1e-4] * 16])
    q = nvfp4_quantize(x)
    assert q.decode_scales.tolist() == [[448.0, 0.0]]
    assert torch.equal(q.dequantized[0, 16:], torch.zeros(16))
    st = nvfp4_quant_stats(x)
    assert st["underflow_pct"] == 0.0  # TE counts E2M1 codes: they are 6, not 0
    assert st["mse"] == pytest.approx(16 * 1e-8 / 32, rel=1e-3)
    # Saturation: no block scale exceeds 448, the amax element maps to exactly 6.
    x = torch.randn(64, 64) * 1e30
    q = nvfp4_quantize(x)
    assert q.decode_scales.max().item() == 448.0 and q.codes.abs().max().item() == 6.0
    assert torch.isfinite(q.dequantized).all()
    # Scaling by a power of two changes no statistic but the magnitudes (no float32 overflow in the sums).
    base = torch.randn(32, 64)
    s1, s2 = nvfp4_quant_stats(base), nvfp4_quant_stats(base * 2.0**100)
    for k in ("sqnr_db", "cos", "underflow_pct", "overflow_pct"):
        assert s2[k] == pytest.approx(s1[k], rel=1e-6), k
    assert s2["mse"] == pytest.approx(s1["mse"] * 2.0**200, rel=1e-6)


def test_two_d_tiles_share_one_scale_and_are_transposition_invariant() -> None:
    torch.manual_seed(0)
    w = torch.randn(40, 48)
    w[:16, :16] *= 100  # one loud tile
    q = nvfp4_quantize(w, NVFP4Options(tile_2d=True))
    assert q.decode_scales.shape == (3, 3)
    tile = w[:16, :16].abs().amax()
    assert q.global_amax.item() == tile.item() and q.decode_scales[0, 0].item() == 448.0
    qt = nvfp4_quantize(w.t().contiguous(), NVFP4Options(tile_2d=True))
    assert torch.equal(qt.dequantized, q.dequantized.t())
    one_d = nvfp4_quantize(w)
    assert one_d.decode_scales.shape == (40, 3)
    assert not torch.equal(nvfp4_quantize(w.t().contiguous()).dequantized, one_d.dequantized.t())


def test_hadamard_is_te_matrix_orthonormal_and_invertible() -> None:
    h = hadamard_matrix()
    assert torch.allclose(h @ h.t(), torch.eye(16), atol=1e-6)
    sylvester = torch.tensor([[(-1.0) ** bin(i & j).count("1") for j in range(16)] for i in range(16)])
    assert torch.allclose(h, torch.diag(torch.tensor(RHT_SIGNS)) @ sylvester / 4)
    torch.manual_seed(1)
    x = torch.randn(8, 64)
    y = random_hadamard_transform(x)
    assert torch.allclose(random_hadamard_transform(y, inverse=True), x, atol=1e-5)
    assert torch.allclose(y.reshape(-1, 16).norm(dim=1), x.reshape(-1, 16).norm(dim=1), rtol=1e-5)
    # A spike spreads over its 16-group: amax falls by 4x (|H| entries are 1/4).
    spike = torch.zeros(1, 16)
    spike[0, 3] = 8.0
    assert torch.allclose(random_hadamard_transform(spike).abs(), torch.full((1, 16), 2.0))
    # wgrad invariance: (dY^T H)(X^T H)^T = dY^T X, so the RHT changes only the quantisation.
    g, xs = torch.randn(32, 24), torch.randn(32, 40)
    wg = columnwise_operand(g, True) @ columnwise_operand(xs, True).t()
    assert torch.allclose(wg, g.t() @ xs, atol=1e-4)
    assert torch.equal(random_hadamard_transform(torch.ones(2, 17)), torch.ones(2, 17))


def test_rht_columnwise_statistics_describe_the_transformed_operand() -> None:
    torch.manual_seed(2)
    x = torch.randn(64, 32)
    x[5, 7] = 60.0  # an outlier in one token column
    plain = nvfp4_quant_stats(x, columnwise=True)
    rht = nvfp4_quant_stats(x, NVFP4Options(rht=True), columnwise=True)
    assert rht["amax"] < plain["amax"] / 2  # the outlier is spread over 16 tokens
    op = columnwise_operand(x, True)
    q = nvfp4_quantize(op)
    want = ((op - q.dequantized) ** 2).mean().item()
    assert rht["mse"] == pytest.approx(want, rel=1e-6)


def test_partial_merges_like_other_partials() -> None:
    torch.manual_seed(3)
    a, b = torch.randn(16, 32), torch.randn(16, 32)
    from fp8track.numerics.stats import finalize, merge_partials

    merged = finalize(merge_partials([nvfp4_partial_stats(a), nvfp4_partial_stats(b)]), "e2m1")
    qa, qb = nvfp4_quantize(a), nvfp4_quantize(b)
    err = ((a - qa.dequantized) ** 2).sum() + ((b - qb.dequantized) ** 2).sum()
    assert merged["mse"] == pytest.approx(err.item() / 1024, rel=1e-6)
    assert merged["numel"] == 1024


def test_against_torchao_nvfp4_on_cpu() -> None:
    nvt = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")
    torch.manual_seed(0)
    checked = 0
    for _ in range(5):
        x = torch.randn(128, 256) * torch.exp(torch.randn(128, 1) * 3)
        amax = x.abs().amax()
        scales, packed = nvt.nvfp4_quantize(x, 16, nvt.per_tensor_amax_to_scale(amax))
        codes = kernels.f4_unpacked_to_f32(kernels.unpack_uint4(packed)).reshape(x.shape)
        q = nvfp4_quantize(x)
        # torchao clamps block scales to E4M3's smallest normal (2**-6); TE keeps subnormal scales.
        normal = q.decode_scales >= 2.0**-6
        assert torch.equal(scales.float()[normal], q.decode_scales[normal])
        mask = normal.repeat_interleave(16, dim=1)
        assert torch.equal(codes[mask], q.codes[mask])
        checked += int(mask.sum())
    assert checked > 100_000


def test_max_blockwise_dynamic_range_hand_worked() -> None:
    x = torch.zeros(2, 64)
    x[0, :3] = torch.tensor([1.0, 0.25, 0.5])  # block 0: log2(1/0.25) = 2
    x[1, 32:34] = torch.tensor([8.0, 1.0])  # block 3: 3
    assert max_blockwise_dynamic_range(x, 32, 1) == pytest.approx(3.0)
    assert max_blockwise_dynamic_range(torch.zeros(4, 32), 32, 1) == 0.0
    t = torch.zeros(32, 32)
    t[0, 0], t[15, 15], t[16, 16] = 4.0, 0.5, 1.0  # tile (0,0): 3; tile (1,1): 0
    assert max_blockwise_dynamic_range(t, 16, 2) == pytest.approx(3.0)
    assert max_blockwise_dynamic_range(t, 16, 1) == 0.0  # each 1x16 block holds one value
    assert math.isfinite(max_blockwise_dynamic_range(torch.randn(3, 50), 32, 1))
    # TE's max_over_orientations: the transposed tensor's blocks too (columns here).
    c = torch.ones(32, 32)
    c[0, 0], c[1, 0] = 4.0, 0.25  # rows: 2 binades; column 0: 4
    assert max_blockwise_dynamic_range(c, 32, 1) == pytest.approx(2.0)
    assert max_blockwise_dynamic_range(c, 32, 1, max_over_orientations=True) == pytest.approx(4.0)
    assert max_blockwise_dynamic_range(c.t(), 32, 1) == pytest.approx(4.0)
    # 2-D tiles of the transpose are the transposed tiles: the same value either way.
    assert max_blockwise_dynamic_range(t, 16, 2, max_over_orientations=True) == pytest.approx(3.0)
    # Non-finite elements count as 0; a partial block is padded with zeros (no change).
    n = torch.tensor([[float("inf"), 2.0, 0.5, float("nan")]])
    assert max_blockwise_dynamic_range(n, 32, 1) == pytest.approx(2.0)


def _loop_block_range(t: torch.Tensor, bs: int, dims: int) -> float:
    """max_blockwise_dynamic_range by loops over zero-padded blocks (TE's definition)."""
    rows = bs if dims == 2 else 1
    t = torch.nn.functional.pad(t, (0, (-t.shape[1]) % bs, 0, (-t.shape[0]) % rows))
    best = 0.0
    for i in range(0, t.shape[0], rows):
        for j in range(0, t.shape[1], bs):
            block = t[i : i + rows, j : j + bs].flatten().tolist()
            nz = [abs(v) for v in block if v != 0 and math.isfinite(v)]
            if nz:
                best = max(best, math.log2(max(nz)) - math.log2(min(nz)))
    return best


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blockwise_dynamic_range_matches_a_loop_in_every_orientation(dtype) -> None:
    from fp8track.numerics.nvfp4 import blockwise_dynamic_range

    torch.manual_seed(0)
    for shape in [(40, 70), (33, 16), (5, 3)]:
        x = (torch.randn(*shape) * torch.exp2(torch.randint(-20, 20, shape).float())).to(dtype)
        x[0, 0], x[1, 1] = 0.0, float("inf")
        xf = x.float()
        for bs, dims in [(32, 1), (16, 1), (16, 2), (4, 2)]:
            row, col = _loop_block_range(xf, bs, dims), _loop_block_range(xf.t().contiguous(), bs, dims)
            assert float(blockwise_dynamic_range(x, bs, dims)) == pytest.approx(row, abs=1e-4)
            column = float(blockwise_dynamic_range(x, bs, dims, columnwise=True))
            assert column == pytest.approx(col, abs=1e-4)
            both = float(blockwise_dynamic_range(x, bs, dims, max_over_orientations=True))
            assert both == pytest.approx(max(row, col), abs=1e-4)
