"""Statistics engine: hand-worked values, an independent NumPy/ml_dtypes reference, properties,
compiled-vs-eager agreement and the exact emulated FP8 rounding."""

from __future__ import annotations

import math
import warnings
import zlib

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8track.errors import ConfigError
from fp8track.numerics import kernel_policy, stats, stats_kernel
from fp8track.numerics.stats import (
    PARTIAL_SIZE,
    STAT_NAMES,
    block_quant_stats,
    finalize,
    merge_partials,
    partial_stats,
    quant_stats,
)

COUNT_KEYS = ("underflow_pct", "overflow_pct", "nonfinite_pct", "numel", "amax", "amin", "scale")
ML_DTYPES = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
FMT_MAX = {"e4m3": 448.0, "e5m2": 57344.0}


@pytest.fixture(params=["eager", "compiled"])
def mode(request):
    stats.set_compile(request.param)
    yield request.param
    stats.set_compile("auto")


# --- hand-worked -----------------------------------------------------------------------------------


def test_hand_worked_overflow_and_underflow_e4m3_scale_1(mode):
    # e4m3, scale 1: x = [0.25, 1000, 0, -3, 2^-10]. N = 5 (all finite).
    #  0.25, -3: exact in e4m3.  1000 > 448: overflows, saturates to 448 (error 552).
    #  2^-10 is half the smallest subnormal 2^-9: a tie, rounds to even = 0 -> underflow (error 2^-10).
    #  nnz(x) = 4, nnz(d) = 3 -> underflow 1/5 = 20 %; overflow 1/5 = 20 %.
    #  sum err^2 = 552^2 + 2^-20 = 304704 + 2^-20; mse = that / 5.
    #  sum x^2 = 0.0625 + 1e6 + 9 + 2^-20; sum d^2 = 0.0625 + 448^2 + 9 = 200713.0625;
    #  sum x d = 0.0625 + 448000 + 9 = 448009.0625.
    #  amax 1000, amin 2^-10, range log2(1000) + 10; current scale 448/1000 = 0.448,
    #  drift log2(1 / 0.448), with the current scale rounded to float32 as the backends compute it.
    x = torch.tensor([0.25, 1000.0, 0.0, -3.0, 2.0**-10])
    s = quant_stats(x, "e4m3", scale=1.0)
    sx2 = 1000009.0625 + 2.0**-20
    se2 = 304704.0 + 2.0**-20
    assert s["underflow_pct"] == 20.0 and s["overflow_pct"] == 20.0
    assert s["amax"] == 1000.0 and s["amin"] == 2.0**-10
    assert s["dynamic_range_log2"] == pytest.approx(math.log2(1000) + 10, rel=1e-12)
    assert s["mse"] == pytest.approx(se2 / 5, rel=1e-7)
    assert s["cos"] == pytest.approx(448009.0625 / math.sqrt(sx2 * 200713.0625), rel=1e-7)
    assert s["sqnr_db"] == pytest.approx(10 * math.log10(sx2 / se2), rel=1e-7)
    assert s["scale"] == 1.0
    cur32 = float(np.float32(448.0) / np.float32(1000.0))
    assert s["current_scale"] == cur32 and cur32 == pytest.approx(0.448, rel=2**-24)
    assert s["scale_drift_log2"] == -math.log2(cur32)
    assert s["nonfinite_pct"] == 0.0 and s["numel"] == 5.0


def test_hand_worked_ties_round_to_even(mode):
    # e4m3 spacing in [1, 2) is 2^-3. 1.0625 lies halfway between 1.0 (mantissa 000) and 1.125 (001):
    # ties to even -> 1.0. 1.1875 lies halfway between 1.125 (001) and 1.25 (010) -> 1.25.
    # Errors 0.0625 and -0.0625: mse = 0.00390625. sum x^2 = 1.12890625 + 1.41015625 = 2.5390625,
    # sum d^2 = 1 + 1.5625, sum x d = 1.0625 + 1.484375; sqnr = 10 log10(2.5390625 / 0.0078125)
    # = 10 log10(325).
    s = quant_stats(torch.tensor([1.0625, 1.1875]), "e4m3", scale=1.0)
    assert s["mse"] == pytest.approx(0.00390625, rel=1e-9)
    assert s["sqnr_db"] == pytest.approx(10 * math.log10(325), rel=1e-9)
    assert s["cos"] == pytest.approx(2.546875 / math.sqrt(2.5390625 * 2.5625), rel=1e-9)
    assert s["underflow_pct"] == 0.0 and s["overflow_pct"] == 0.0


def test_hand_worked_current_scaling_e5m2_with_nonfinite(mode):
    # x = [nan, inf, 4, -1, 0]: nonfinite 2/5 = 40 %, N = 3 finite. amax 4, current scale
    # 57344 / 4 = 14336 = 1.75 * 2^13; 4 * s = 57344 = max, -1 * s = -1.75 * 2^13: both exact in e5m2
    # (mantissa 1.11b), so no error: mse 0, cos 1, sqnr +inf, no under/overflow. amin 1, range 2.
    s = quant_stats(torch.tensor([math.nan, math.inf, 4.0, -1.0, 0.0]), "e5m2")
    assert s == {
        "amax": 4.0,
        "amin": 1.0,
        "dynamic_range_log2": 2.0,
        "underflow_pct": 0.0,
        "overflow_pct": 0.0,
        "mse": 0.0,
        "cos": 1.0,
        "sqnr_db": math.inf,
        "scale": 14336.0,
        "current_scale": 14336.0,
        "scale_drift_log2": 0.0,
        "nonfinite_pct": 40.0,
        "numel": 5.0,
        "zero_pct": 100.0 / 3.0,  # one exact zero among the 3 finite elements
    }


def test_margin_halves_current_scale(mode):
    # margin 2: scale = 448 / 8 / 4 = 14; 8 * 14 = 112 exact in e4m3 (1.75 * 2^6).
    s = quant_stats(torch.tensor([8.0, -8.0]), "e4m3", margin=2)
    assert s["scale"] == 14.0 and s["current_scale"] == 14.0 and s["mse"] == 0.0


# --- edge cases ------------------------------------------------------------------------------------


def test_empty_tensor_has_defined_stats():
    s = quant_stats(torch.empty(0), "e4m3")
    assert set(s) == set(STAT_NAMES)
    assert s["numel"] == 0.0 and s["amax"] == 0.0 and s["mse"] == 0.0 and s["cos"] == 1.0
    assert s["scale"] == s["current_scale"] == 1.0 and s["scale_drift_log2"] == 0.0


def test_all_zeros(mode):
    s = quant_stats(torch.zeros(3000, dtype=torch.bfloat16), "e4m3")
    assert s["amax"] == 0.0 and s["amin"] == 0.0 and s["dynamic_range_log2"] == 0.0
    assert s["underflow_pct"] == 0.0 and s["mse"] == 0.0 and s["cos"] == 1.0 and s["sqnr_db"] == math.inf
    assert s["scale"] == 1.0 and s["numel"] == 3000.0


def test_all_nonfinite(mode):
    s = quant_stats(torch.tensor([math.nan, math.inf, -math.inf]), "e4m3")
    assert s["nonfinite_pct"] == 100.0 and s["amax"] == 0.0 and s["mse"] == 0.0 and s["numel"] == 3.0


def test_float32_subnormal_only_tensor(mode):
    # amax = 1e-40: 448 / amax overflows float32 and is clamped to float32 max (TE's guard).
    x = torch.full((4,), 1e-40)
    s = quant_stats(x, "e4m3")
    assert s["scale"] == torch.finfo(torch.float32).max
    assert s["amax"] == pytest.approx(1e-40, rel=1e-3)
    assert all(math.isfinite(s[k]) for k in ("mse", "cos", "underflow_pct"))
    assert s["underflow_pct"] == 0.0  # 1e-40 * 3.4e38 = 0.034 is a normal e4m3 number


def test_fp8_subnormal_range_at_scale_1(mode):
    # 2^-9 (smallest e4m3 subnormal) and 3 * 2^-9 are exact; 2^-11 rounds to 0.
    s = quant_stats(torch.tensor([2.0**-9, 3 * 2.0**-9, 2.0**-11]), "e4m3", scale=1.0)
    assert s["underflow_pct"] == pytest.approx(100 / 3)
    assert s["mse"] == pytest.approx(2.0**-22 / 3, rel=1e-9)


def test_zero_and_infinite_scale(mode):
    x = torch.tensor([1.0, -2.0, 0.0, 4.0])
    for scale in (0.0, math.inf):
        s = quant_stats(x, "e4m3", scale=scale)
        # Every nonzero element dequantises to 0 (q = 0 for s = 0; q / inf = 0 for s = inf).
        assert s["underflow_pct"] == 75.0
        assert s["mse"] == pytest.approx(21 / 4) and s["cos"] == 0.0 and s["sqnr_db"] == 0.0
    assert quant_stats(x, "e4m3", scale=math.inf)["overflow_pct"] == 75.0
    assert quant_stats(x, "e4m3", scale=0.0)["overflow_pct"] == 0.0
    assert quant_stats(x, "e4m3", scale=0.0)["scale_drift_log2"] == -math.inf
    assert quant_stats(x, "e4m3", scale=math.inf)["scale_drift_log2"] == math.inf


@pytest.mark.parametrize("bad", [-1.0, math.nan, torch.tensor([1.0, -2.0])])
def test_negative_or_nan_scale_is_a_value_error(bad):
    with pytest.raises(ValueError, match="scale must be >= 0"):
        quant_stats(torch.ones(4), "e4m3", scale=bad)


def test_unknown_format_lists_valid_names():
    with pytest.raises(ValueError, match=r"'e3m4'.*'e4m3', 'e5m2'"):
        quant_stats(torch.ones(4), "e3m4")
    with pytest.raises(ConfigError, match="mxfp8"):
        block_quant_stats(torch.ones(4, 4), "mx9")


def test_set_compile_rejects_unknown_mode():
    with pytest.raises(ConfigError, match="'turbo'.*'auto', 'aot', 'compiled', 'eager'"):
        stats.set_compile("turbo")


# --- independent reference -------------------------------------------------------------------------


def reference_stats(x: np.ndarray, fmt: str, scale: float | None, margin: int = 0) -> dict[str, float]:
    """Plain float64 NumPy implementation of docs/statistics.md, rounding through ml_dtypes.

    As in fp8track, ``x * s`` and ``q / s`` are float32 operations (what the kernel and Transformer
    Engine compute); everything else is float64.
    """
    m = FMT_MAX[fmt]
    finite = np.isfinite(x)
    xv = x[finite].astype(np.float64)
    n = xv.size
    a = np.abs(xv)
    amax = float(a.max()) if n else 0.0
    nz = a[a > 0]
    amin = float(nz.min()) if nz.size else 0.0
    if amax > 0:
        cur32 = np.float32(np.float32(m) / np.float32(amax)) * np.float32(2.0**-margin)
        cur32 = min(cur32, np.finfo(np.float32).max)
    else:
        cur32 = np.float32(1.0)
    s = np.float32(cur32 if scale is None else scale)
    x32 = xv.astype(np.float32)
    xs = np.where(x32 == 0, np.float32(0), x32 * s)
    over = np.abs(xs) > np.float32(m) * np.float32(1 + 2.0**-22)
    q = np.clip(xs, -m, m).astype(ML_DTYPES[fmt]).astype(np.float32)
    d = np.where(q == 0, np.float32(0), q / s).astype(np.float64)
    err = xv - d
    sx2, sd2, sxd, se2 = (xv * xv).sum(), (d * d).sum(), (xv * d).sum(), (err * err).sum()
    cur = m / amax / 2.0**margin if amax > 0 else 1.0
    cur = min(cur, float(np.finfo(np.float32).max))
    return {
        "amax": amax,
        "amin": amin,
        "dynamic_range_log2": math.log2(amax) - math.log2(amin) if amin > 0 else 0.0,
        "underflow_pct": 100.0 * (np.count_nonzero(xv) - np.count_nonzero(d)) / n,
        "overflow_pct": 100.0 * over.sum() / n,
        "mse": se2 / n,
        "cos": sxd / math.sqrt(sx2 * sd2) if sx2 > 0 and sd2 > 0 else float(sx2 == sd2),
        "sqnr_db": 10 * math.log10(sx2 / se2) if se2 > 0 else math.inf,
        "scale": float(s),
        "current_scale": cur,
        "scale_drift_log2": math.log2(float(s)) - math.log2(cur),
        "nonfinite_pct": 100.0 * (x.size - n) / x.size,
        "numel": float(x.size),
        "zero_pct": 100.0 * (n - np.count_nonzero(xv)) / n,
    }


def assert_stats_close(got: dict[str, float], ref: dict[str, float], context: str = "") -> None:
    assert set(got) == set(STAT_NAMES), context
    for k in COUNT_KEYS:
        assert got[k] == ref[k], f"{context} {k}: {got[k]} != {ref[k]}"
    for k in ("mse", "dynamic_range_log2", "current_scale"):
        assert got[k] == pytest.approx(ref[k], rel=1e-5, abs=1e-30), f"{context} {k}"
    assert got["cos"] == pytest.approx(ref["cos"], rel=1e-6), f"{context} cos"
    assert got["sqnr_db"] == pytest.approx(ref["sqnr_db"], rel=1e-5, abs=1e-4), f"{context} sqnr_db"
    assert got["scale_drift_log2"] == pytest.approx(ref["scale_drift_log2"], abs=1e-6), context


def _sample(dist: str, n: int, gen: torch.Generator) -> torch.Tensor:
    if dist == "normal":
        return torch.randn(n, generator=gen)
    if dist == "lognormal":
        sign = torch.randint(0, 2, (n,), generator=gen) * 2 - 1
        return sign * torch.exp(3 * torch.randn(n, generator=gen))
    if dist == "uniform":
        return torch.rand(n, generator=gen) * 200 - 100
    if dist == "zeros":
        x = torch.randn(n, generator=gen)
        return torch.where(torch.rand(n, generator=gen) < 0.3, 0.0, x)
    if dist == "subnormal":  # e4m3 subnormal range at scale 1 (2^-9 .. 2^-6) and below
        return torch.randn(n, generator=gen) * 2.0**-8
    raise AssertionError(dist)


SCALE_CHOICES = ("current", "too_large", "too_small", "one")


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dist", ["normal", "lognormal", "uniform", "zeros", "subnormal"])
def test_matches_numpy_reference(mode, fmt, dtype, dist):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{fmt}{dtype}{dist}".encode()))
    x = _sample(dist, 5000, gen).to(dtype)
    x[7] = math.nan
    xnp = x.float().numpy().astype(np.float64)
    cur = reference_stats(xnp, fmt, None)["current_scale"]
    for which in SCALE_CHOICES:
        # too small: shift the data this many binades down, past the format's subnormals
        shift = 2.0 ** -(12 if fmt == "e4m3" else 22)
        scale = {"current": None, "too_large": cur * 64, "too_small": cur * shift, "one": 1.0}[which]
        got = quant_stats(x, fmt, scale=scale)
        ref = reference_stats(xnp, fmt, scale)
        assert_stats_close(got, ref, f"{mode} {fmt} {dtype} {dist} {which}")
        if which == "too_large":
            assert got["overflow_pct"] > 0
        if which == "too_small":
            assert got["underflow_pct"] > 0


def reference_block_stats(x: np.ndarray, recipe: str, fmt: str) -> dict[str, float]:
    """Block recipes in NumPy: blocks padded with zeros, scales computed here from each block's amax."""
    m = FMT_MAX[fmt]
    x2 = x.reshape(-1, x.shape[-1])
    if recipe == "block128x128":
        r, c = x2.shape
        pr, pc = -r % 128, -c % 128
        padded = np.pad(x2, ((0, pr), (0, pc)))
        blocks = padded.reshape(padded.shape[0] // 128, 128, padded.shape[1] // 128, 128).transpose(
            0, 2, 1, 3
        )
        blocks = blocks.reshape(-1, 128 * 128)
        valid = np.pad(np.ones_like(x2, dtype=bool), ((0, pr), (0, pc)))
        valid = valid.reshape(blocks.shape[0] // (padded.shape[1] // 128), 128, -1, 128).transpose(0, 2, 1, 3)
        valid = valid.reshape(-1, 128 * 128)
    else:
        b = 32 if recipe == "mxfp8" else 128
        pc = -x2.shape[1] % b
        blocks = np.pad(x2, ((0, 0), (0, pc))).reshape(-1, b)
        valid = np.pad(np.ones_like(x2, dtype=bool), ((0, 0), (0, pc))).reshape(-1, b)
    bamax = np.where(np.isfinite(blocks), np.abs(blocks), 0).max(axis=1)
    with np.errstate(divide="ignore"):
        if recipe == "mxfp8":
            e = np.ceil(np.log2(bamax / m))  # TE rounds the E8M0 scale_inv up
            e = np.where(bamax > 0, np.clip(e, -127, 127), -127)
            scales = 2.0**-e
        else:
            scales = np.where(bamax > 0, 2.0 ** np.floor(np.log2(m / bamax)), 1.0)
    per_el = np.repeat(scales, blocks.shape[1]).reshape(blocks.shape)
    xv, sv = blocks[valid], per_el[valid]
    finite = np.isfinite(xv)
    xv, sv = xv[finite], sv[finite]
    x32, s32 = xv.astype(np.float32), sv.astype(np.float32)
    xs = np.where(x32 == 0, np.float32(0), x32 * s32)
    q = np.clip(xs, -m, m).astype(ML_DTYPES[fmt]).astype(np.float32)
    d = np.where(q == 0, np.float32(0), q / s32).astype(np.float64)
    err = xv - d
    n = xv.size
    amax = float(np.abs(xv).max())
    scale_used = float(scales[bamax > 0].min())
    cur = m / amax
    return {
        "underflow_pct": 100.0 * (np.count_nonzero(xv) - np.count_nonzero(d)) / n,
        "overflow_pct": 100.0 * (np.abs(xs) > m * (1 + 2.0**-22)).sum() / n,
        "mse": (err * err).sum() / n,
        "cos": (xv * d).sum() / math.sqrt((xv * xv).sum() * (d * d).sum()),
        "scale": scale_used,
        "current_scale": cur,
        "scale_drift_log2": math.log2(scale_used / cur),
        "amax": amax,
        "numel": float(x.size),
    }


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize(
    ("recipe", "shape"), [("mxfp8", (130, 70)), ("block128", (5, 300)), ("block128x128", (200, 150))]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_recipes_match_numpy_reference(recipe, shape, fmt, dtype):
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(shape, generator=gen) * torch.exp(2 * torch.randn(shape, generator=gen))).to(dtype)
    x[0, 0] = 0.0
    got = block_quant_stats(x, recipe, fmt)
    ref = reference_block_stats(x.float().numpy().astype(np.float64), recipe, fmt)
    for k in ("underflow_pct", "overflow_pct", "scale", "amax", "numel"):
        assert got[k] == ref[k], k
    for k in ("mse", "current_scale"):
        assert got[k] == pytest.approx(ref[k], rel=1e-5), k
    assert got["cos"] == pytest.approx(ref["cos"], rel=1e-6)
    assert got["scale_drift_log2"] == pytest.approx(ref["scale_drift_log2"], abs=1e-6)
    assert got["overflow_pct"] == 0.0  # block scales never clip the block's amax


def test_block_recipe_all_zero_tensor_reports_defined_scale():
    s = block_quant_stats(torch.zeros(4, 64), "block128", "e4m3")
    assert s["scale"] == 1.0 and s["mse"] == 0.0 and s["numel"] == 256.0


# --- properties ------------------------------------------------------------------------------------

finite_floats = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, width=32)
values = st.lists(
    st.one_of(finite_floats, st.sampled_from([0.0, math.nan, math.inf, 2.0**-12])), min_size=1, max_size=60
)


@settings(max_examples=60, deadline=None)
@given(vals=values, cuts=st.lists(st.integers(0, 60), max_size=4), fmt=st.sampled_from(["e4m3", "e5m2"]),
       scale=st.sampled_from([None, 1.0, 3.5, 1e-3]))
def test_merge_over_any_split_equals_whole(vals, cuts, fmt, scale):
    x = torch.tensor(vals, dtype=torch.float32)
    # Merging needs one shared scale (current scaling per part would differ): use the whole's.
    s = scale if scale is not None else float(partial_stats(x, fmt)[stats._IDX["scale_max"]])
    bounds = sorted({min(c, len(vals)) for c in cuts} | {0, len(vals)})
    parts = [partial_stats(x[a:b], fmt, s) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    whole = finalize(partial_stats(x, fmt, s), fmt)
    merged = finalize(merge_partials(parts), fmt)
    for k in STAT_NAMES:
        assert merged[k] == pytest.approx(whole[k], rel=1e-9, abs=1e-12), k


@settings(max_examples=40, deadline=None)
@given(vals=values, seed=st.integers(0, 2**16), fmt=st.sampled_from(["e4m3", "e5m2"]),
       scale=st.sampled_from([None, 1.0, 1e3, 0.0, math.inf]))
def test_order_invariance_and_bounds(vals, seed, fmt, scale):
    x = torch.tensor(vals, dtype=torch.float32)
    perm = torch.randperm(len(vals), generator=torch.Generator().manual_seed(seed))
    a, b = quant_stats(x, fmt, scale), quant_stats(x[perm], fmt, scale)
    for k in STAT_NAMES:
        assert a[k] == pytest.approx(b[k], rel=1e-9, abs=1e-12) or (math.isnan(a[k]) and math.isnan(b[k])), k
    assert 0.0 <= a["underflow_pct"] <= 100.0 and 0.0 <= a["overflow_pct"] <= 100.0
    assert -1.0 <= a["cos"] <= 1.0 and a["mse"] >= 0.0


def test_all_reduce_partials_single_process_gloo(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        p = torch.stack(
            [partial_stats(torch.randn(50), "e4m3", 2.0), partial_stats(torch.randn(7), "e4m3", 2.0)]
        )
        assert torch.equal(stats.all_reduce_partials(p), p)
    finally:
        dist.destroy_process_group()


# --- compiled kernel -------------------------------------------------------------------------------


def _all_patterns(dtype: torch.dtype) -> torch.Tensor:
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    v = bits.view(dtype).float()
    return v[torch.isfinite(v)]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_emulated_rounding_is_bit_exact_on_every_bf16_and_fp16_value(fmt):
    f = stats.get_format(fmt)
    fconst = stats_kernel._fmt_consts(f, 0, torch.device("cpu"))
    compiled = torch.compile(stats_kernel.round_to_fp8_grid)
    for dtype in (torch.bfloat16, torch.float16):
        v = _all_patterns(dtype)
        for s in (1.0, 448.0 / 3.0, 2.0**-10, 1e5, 0.37):
            vs = (v * s).clamp(-f.max, f.max)
            want = vs.to(f.dtype).float()
            for fn in (stats_kernel.round_to_fp8_grid, compiled):
                got = fn(vs, fconst)
                assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (fmt, dtype, s)


def test_compiled_and_eager_agree(tmp_path):
    gen = torch.Generator().manual_seed(3)
    cases = [
        torch.randn(3000, generator=gen).to(torch.bfloat16),
        (torch.randn(64, 257, generator=gen) * 1e3).to(torch.float16),
        torch.exp(4 * torch.randn(40000, generator=gen)),
        torch.randn(16 * 64, 64, generator=gen),  # a multiple of the row length: the tail-free graph
        torch.randn(1024, generator=gen).to(torch.bfloat16),  # exactly one row
    ]
    cases[2][::13] = 0.0
    cases[2][5] = math.inf
    try:
        for x in cases:
            for fmt, scale in (("e4m3", None), ("e5m2", 0.01), ("e4m3", 1e4)):
                stats.set_compile("eager")
                e = partial_stats(x, fmt, scale)
                stats.set_compile("compiled")
                c = partial_stats(x, fmt, scale)
                assert c.shape == (PARTIAL_SIZE,)
                assert torch.equal(c[:5], e[:5])  # counts exactly
                assert torch.allclose(c[5:9], e[5:9], rtol=1e-6, atol=0)
                assert torch.equal(c[9:], e[9:])  # amax, amin, scale
    finally:
        stats.set_compile("auto")


def test_row_length_bounds_the_rows_and_stays_a_power_of_two(monkeypatch):
    monkeypatch.setitem(stats.MAX_ROWS, "cpu", 8)
    for n in (1, 1024, 8 * 1024, 8 * 1024 + 1, 100_000, 4096 * 4096, 16384 * 16384):
        c = stats.row_length(n, "cpu")
        assert c >= 1024 and c & (c - 1) == 0  # a power of two, at least the default row
        assert -(-n // c) <= 8  # rows bounded
        assert c == 1024 or -(-n // (c // 2)) > 8  # and no longer than that needs
    assert stats.row_length(16384 * 16384, "cuda") == 65536  # 4096 rows on a GPU
    monkeypatch.delitem(stats.MAX_ROWS, "cpu")
    assert stats.row_length(16384 * 16384, "cpu") == 1024  # unbounded: rows stay 1024 long


def test_longer_rows_agree_with_eager_and_get_a_kernel_each(monkeypatch):
    """The GPU's row-length rule, run on CPU: several row lengths, each its own compiled kernel, with
    and without a padded tail, all equal to the eager path (counts exactly, sums to rounding).
    Long (about 1 min on 2 cores): inductor compiles three kernels, with and without a tail: the claim."""
    monkeypatch.setitem(stats.MAX_ROWS, "cpu", 4)
    monkeypatch.setattr(stats._POLICY, "kernels", {})
    monkeypatch.setattr(kernel_policy, "DIRECT_DEVICES", ())  # torch.compile, as on a GPU
    gen = torch.Generator().manual_seed(11)
    sizes = (3000, 4 * 1024, 4 * 2048, 4 * 4096 + 5, 20_000)  # row lengths 1024, 1024, 2048, 8192, 8192
    try:
        for n in sizes:
            x = (torch.randn(n, generator=gen) * torch.logspace(-3, 3, n)).to(torch.bfloat16)
            stats.set_compile("eager")
            e = partial_stats(x, "e4m3")
            stats.set_compile("compiled")
            c = partial_stats(x, "e4m3")
            assert torch.equal(c[:5], e[:5]), n
            assert torch.allclose(c[5:9], e[5:9], rtol=1e-6, atol=0), n
            assert torch.equal(c[9:], e[9:]), n
    finally:
        stats.set_compile("auto")
    assert sorted(stats._POLICY.kernels) == [("cpu", 1024), ("cpu", 2048), ("cpu", 8192)]


def test_compiled_inside_autograd_hooks_matches_eager():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64)
    seen: dict[str, torch.Tensor] = {}

    def fwd_hook(module, inputs, output):
        seen["act"] = partial_stats(inputs[0], "e4m3")
        output.register_hook(lambda g: seen.__setitem__("grad", partial_stats(g, "e5m2")))

    lin.register_forward_hook(fwd_hook)
    x = torch.randn(64, 64, requires_grad=True)
    try:
        stats.set_compile("compiled")
        lin(x).square().sum().backward()
        stats.set_compile("eager")
        want_act = partial_stats(x, "e4m3")
        grad = 2 * lin(x).detach()
        want_grad = partial_stats(grad, "e5m2")
    finally:
        stats.set_compile("auto")
    assert torch.equal(seen["act"][:5], want_act[:5])
    assert torch.allclose(seen["act"], want_act, rtol=1e-6)
    assert torch.equal(seen["grad"][:5], want_grad[:5])
    assert torch.allclose(seen["grad"], want_grad, rtol=1e-6)


def test_failed_compilation_warns_once_and_falls_back(monkeypatch):
    monkeypatch.setattr(kernel_policy, "DIRECT_DEVICES", ())  # torch.compile, as on a GPU

    def broken_backend(gm, example_inputs):
        raise RuntimeError("no C++ compiler here")

    x = torch.randn(5000)
    old = dict(stats._POLICY.kernels)
    stats.set_compile("compiled")
    # Dynamo caches compiled frames per code object: after earlier tests filled that cache (up to its
    # recompile limit it then runs eager silently), the broken backend would never be asked.
    torch._dynamo.reset()
    stats._POLICY.kernels[("cpu", stats.row_length(x.numel(), "cpu"))] = torch.compile(
        stats_kernel._compiled_partial, backend=broken_backend
    )
    try:
        with pytest.warns(UserWarning, match="using eager"):
            got = partial_stats(x, "e4m3")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            partial_stats(x, "e4m3")  # no second warning
        stats.set_compile("eager")
        assert torch.equal(got, partial_stats(x, "e4m3"))
    finally:
        torch._dynamo.reset()
        stats._POLICY.kernels = old
        stats.set_compile("auto")


def test_merging_into_an_accumulator_equals_merge_partials(mode):
    # The compiled kernel merges into the accumulator in the same call; eager merges after.
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(4 * 1024, generator=gen).to(torch.bfloat16)
    b = (torch.randn(3000, generator=gen) * 7).to(torch.bfloat16)  # a padded tail row
    acc = partial_stats(a, "e4m3")
    before = acc.clone()
    merged = partial_stats(b, "e4m3", into=acc)
    assert torch.equal(acc, before)  # the accumulator itself is untouched
    want = merge_partials([partial_stats(a, "e4m3"), partial_stats(b, "e4m3")])
    assert torch.equal(merged[:5], want[:5]) and merged[0] == 4096 + 3000
    assert torch.allclose(merged, want, rtol=1e-12, atol=0)
    empty = partial_stats(torch.zeros(0), "e4m3", into=acc)
    assert torch.equal(empty, acc)


def test_inductor_options_this_torch_does_not_know_are_dropped(monkeypatch):
    """One unknown key makes torch.compile refuse the whole kernel (torch 2.11 lacks
    ``realize_cpu_opcount_threshold``): such keys are left out, known ones kept."""
    monkeypatch.setattr(
        stats_kernel, "_INDUCTOR_OPTIONS", {"realize_reads_threshold": 7, "no_such_option_in_any_torch": 1}
    )
    assert stats_kernel._inductor_options() == {"realize_reads_threshold": 7}
