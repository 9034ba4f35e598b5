"""Per-group statistics of a grouped tensor in one pass: each group's partial equals the partial of
that group alone (:func:`fp8track.numerics.stats.partial_stats`), eager and fused by the compile
policy alike."""

from __future__ import annotations

import math

import pytest
import torch

from fp8track.numerics.kernel_policy import get_compile, set_compile
from fp8track.numerics.segment_stats import merge_group_partials, segment_partial_stats
from fp8track.numerics.stats import finalize, partial_stats

SIZES = (37, 0, 64, 1, 154)  # rows per group: an empty group and a one-row group among them


def _grouped(fmt_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(sum(SIZES), 96, generator=g) * fmt_scale
    x[3, 5] = math.inf  # a non-finite element in group 0
    x[40:45] *= 1e5  # a group whose amax sits far above the others'
    x[101] = 0.0  # an all-zero row
    seg = torch.repeat_interleave(torch.arange(len(SIZES)), torch.tensor(SIZES))
    return x, seg


@pytest.fixture
def compile_mode():
    before = get_compile()
    yield set_compile
    set_compile(before)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_each_groups_partial_equals_its_own_and_compiled_equals_eager(fmt, compile_mode):
    x, seg = _grouped()
    compile_mode("eager")
    eager = segment_partial_stats(x, seg, len(SIZES), fmt)
    compile_mode("compiled")
    fused = segment_partial_stats(x, seg, len(SIZES), fmt)
    # the fused pass rounds to the FP8 grid where eager casts: the same values, bit for bit
    assert torch.equal(torch.nan_to_num(fused), torch.nan_to_num(eager))
    start = 0
    for e, n in enumerate(SIZES):
        rows = x[start : start + n]
        start += n
        if n == 0:  # no rows: zero counts, no statistics
            assert fused[e, 0] == 0 and finalize(fused[e], fmt)["numel"] == 0
            continue
        ours, ref = finalize(fused[e], fmt), finalize(partial_stats(rows, fmt), fmt)
        for k, v in ref.items():
            if isinstance(v, float) and math.isnan(v):
                assert math.isnan(ours[k]), k
            else:
                # the reference sums chunks in float32: equal to its rounding
                assert ours[k] == pytest.approx(v, rel=1e-6, abs=1e-12), (e, k, ours[k], v)
    # the group scales differ (group 2 holds the 1e5 rows): each group judged with its own
    assert finalize(fused[2], fmt)["amax"] > 1e4 > finalize(fused[4], fmt)["amax"]
    merged = finalize(merge_group_partials(fused), fmt)
    assert merged["numel"] == x.numel() and merged["amax"] == finalize(fused[2], fmt)["amax"]


def test_a_given_scale_per_group_is_used(compile_mode):
    x, seg = _grouped()
    scale = torch.tensor([1.0, 2.0, 448.0 / 1e5, 4.0, 8.0])
    compile_mode("compiled")
    parts = segment_partial_stats(x, seg, len(SIZES), "e4m3", scale=scale)
    rows = x[38:102]  # group 2
    ref = finalize(partial_stats(rows, "e4m3", scale=scale[2]), "e4m3")
    ours = finalize(parts[2], "e4m3")
    assert ours["mse"] == pytest.approx(ref["mse"], rel=1e-6)
    assert ours["overflow_pct"] == ref["overflow_pct"] > 0  # elements over 1e5 x 1 overflow 448
