"""Statistics partials of many tensors at once: the row groups of one 2-D tensor.

A grouped GEMM's operand holds every expert's rows (the routed tokens sorted by expert, or the
experts' weights stacked); :func:`segment_partial_stats` returns one partial per group in one pass
over the tensor, with no Python loop over groups and no host synchronisation. Each group is judged
with its own scale (one quantizer per expert, as Transformer Engine's ``GroupedLinear``): a given
``[G]`` scale, or current scaling from the group's own amax. The per-element maths is the fused
kernel's (:func:`fp8track.numerics.stats_kernel._row_sums`, the real FP8 cast), so a group's partial
equals :func:`fp8track.numerics.stats.partial_stats` of that group alone up to float64 summation order.
"""

from __future__ import annotations

import math

import torch

from fp8track.numerics.formats import FP8Format, get_format
from fp8track.numerics.scaling import scale_from_amax
from fp8track.numerics.stats_kernel import (
    NUM_SUM,
    PARTIAL_SIZE,
    _fmt_consts,
    _pow2_normaliser,
    _row_sums,
)


def _segment_reduce(
    values: torch.Tensor, seg: torch.Tensor, groups: int, reduce: str, init: float
) -> torch.Tensor:
    out = torch.full((groups + 1,), init, dtype=values.dtype, device=values.device)
    return out.scatter_reduce(0, seg, values, reduce=reduce, include_self=True)[:groups]


@torch.no_grad()
def segment_partial_stats(
    x2d: torch.Tensor,
    seg: torch.Tensor,
    groups: int,
    fmt: str | FP8Format,
    scale: torch.Tensor | None = None,
    margin: int = 0,
) -> torch.Tensor:
    """Partials ``[groups, PARTIAL_SIZE]`` (float64, on ``x2d``'s device) of the row groups of ``x2d``.

    Args:
        x2d: ``[R, C]`` float tensor; row ``r`` belongs to group ``seg[r]``.
        seg: ``[R]`` int64 group index per row; rows with ``seg >= groups`` are ignored.
        groups: number of groups G (a group without rows gets the identity partial: zero counts,
            ``-inf`` maxima, as :func:`~fp8track.numerics.stats_kernel.empty_partial`).
        fmt: the FP8 element format.
        scale: ``[G]`` float32 scales, or ``None`` for current scaling per group
            (``M / amax_g / 2**margin`` with Transformer Engine's guards).
        margin: current scaling's margin.
    """
    fmt = get_format(fmt)
    x2d = x2d.detach()
    dev = x2d.device
    rows, width = x2d.shape
    fconst = _fmt_consts(fmt, margin, dev)
    x32 = x2d.to(torch.float32)
    finite_abs = torch.where(torch.isfinite(x32), x32.abs(), 0.0)
    if width:
        row_amax = finite_abs.amax(dim=1)
        row_amin = torch.where(finite_abs > 0, finite_abs, math.inf).amin(dim=1)
    else:
        row_amax = x32.new_zeros(rows)
        row_amin = x32.new_full((rows,), math.inf)
    amax_g = _segment_reduce(row_amax, seg, groups, "amax", 0.0)
    amin_g = _segment_reduce(row_amin, seg, groups, "amin", math.inf)
    if scale is None:
        s_g = scale_from_amax(amax_g, fconst[0], fconst[1])
    else:
        s_g = scale.to(device=dev, dtype=torch.float32).reshape(groups)
    p_g = _pow2_normaliser(amax_g)
    pad = torch.ones(1, dtype=torch.float32, device=dev)
    s_rows = torch.cat([s_g, pad])[seg].unsqueeze(1)
    p_rows = torch.cat([p_g, pad])[seg].unsqueeze(1)
    sums_rows = _row_sums(x32, s_rows, p_rows, fconst, fmt.dtype, torch.float64)  # [R, NUM_SUM - 1]
    sums = torch.zeros(groups + 1, NUM_SUM - 1, dtype=torch.float64, device=dev)
    sums.index_add_(0, seg, sums_rows)
    sums = sums[:groups]
    inv_p2 = p_g.to(torch.float64).reciprocal().square().unsqueeze(1)
    sums = torch.cat([sums[:, :4], sums[:, 4:] * inv_p2], dim=1)
    counts = torch.zeros(groups + 1, dtype=torch.float64, device=dev)
    counts.index_add_(0, seg, torch.full((rows,), float(width), dtype=torch.float64, device=dev))
    counts = counts[:groups]
    seen = counts > 0
    neg_inf = torch.full_like(counts, -math.inf)
    s64 = s_g.to(torch.float64)
    maxes = torch.stack([
        torch.where(seen, amax_g.to(torch.float64), neg_inf),
        torch.where(seen, -amin_g.to(torch.float64), neg_inf),
        torch.where(seen, s64, neg_inf),
        torch.where(seen, -s64, neg_inf),
    ], dim=1)
    out = torch.cat([counts.unsqueeze(1), sums, maxes], dim=1)
    assert out.shape[1] == PARTIAL_SIZE
    return out


def merge_group_partials(partials: torch.Tensor) -> torch.Tensor:
    """One partial of all groups ``[G, PARTIAL_SIZE] -> [PARTIAL_SIZE]``: sums add, maxima take the
    max (the aggregate row of an expert group, merged as shards of one tensor are)."""
    return torch.cat([partials[:, :NUM_SUM].sum(dim=0), partials[:, NUM_SUM:].amax(dim=0)])
