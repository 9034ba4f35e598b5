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
from fp8track.numerics.kernel_policy import compiled_row_sums
from fp8track.numerics.scaling import BLOCK_LAYOUTS, block_scales, blockify_rows, scale_from_amax
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
    row_scale: torch.Tensor | None = None,
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
        row_scale: ``[R]`` float32 scales, one per row (block recipes: each row one block), used
            instead of the group's; the group's scale range is then that of its rows.
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
    if row_scale is not None:
        s_rows = row_scale.to(device=dev, dtype=torch.float32).reshape(rows, 1)
    else:
        s_rows = torch.cat([s_g, pad])[seg].unsqueeze(1)
    p_rows = torch.cat([p_g, pad])[seg].unsqueeze(1)
    # [R, NUM_SUM - 1]: fused by the compile policy where it compiles, else eager (the same numbers)
    sums_rows = compiled_row_sums(x32, s_rows, p_rows, fconst)
    if sums_rows is None:
        sums_rows = _row_sums(x32, s_rows, p_rows, fconst, fmt.dtype, torch.float64)
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
    if row_scale is None:
        s_max = s_min = s_g.to(torch.float64)
    else:  # the range of the scales of the rows holding data (all rows where none does)
        rs, occupied = s_rows.reshape(rows).to(torch.float64), row_amax > 0
        any_occ = _segment_reduce(occupied.to(torch.float64), seg, groups, "amax", 0.0) > 0
        use = occupied | ~torch.cat([any_occ, any_occ.new_zeros(1)])[seg]
        s_max = _segment_reduce(torch.where(use, rs, -math.inf), seg, groups, "amax", -math.inf)
        s_min = _segment_reduce(torch.where(use, rs, math.inf), seg, groups, "amin", math.inf)
    maxes = torch.stack([
        torch.where(seen, amax_g.to(torch.float64), neg_inf),
        torch.where(seen, -amin_g.to(torch.float64), neg_inf),
        torch.where(seen, s_max, neg_inf),
        torch.where(seen, -s_min, neg_inf),
    ], dim=1)
    out = torch.cat([counts.unsqueeze(1), sums, maxes], dim=1)
    assert out.shape[1] == PARTIAL_SIZE
    return out


def segment_block_partial_stats(
    x2d: torch.Tensor, seg: torch.Tensor, groups: int, layout: str, fmt: str | FP8Format
) -> torch.Tensor:
    """Partials ``[groups, PARTIAL_SIZE]`` of the row groups of ``x2d [R, C]`` under a row block
    layout (``mxfp8`` 1x32, ``block128`` 1x128: blocks along each row, so every block belongs to its
    row's group), each block with its own scale, as
    :func:`fp8track.numerics.stats.block_partial_stats` judges one tensor (padding of a row's last
    block out of the counts; the scale range over the blocks holding data)."""
    fmt = get_format(fmt)
    size, tiles, _ = BLOCK_LAYOUTS[layout]
    if tiles:
        raise ValueError(f"segment_block_partial_stats takes row layouts, not {layout!r} tiles")
    rows = x2d.shape[0]
    blocks, pad = blockify_rows(x2d.detach().to(torch.float32), size)
    per_row = blocks.shape[0] // rows if rows else 0
    _, scale = block_scales(blocks, layout, fmt)
    out = segment_partial_stats(
        blocks, seg.repeat_interleave(per_row), groups, fmt, row_scale=scale.reshape(-1)
    )
    if pad:
        rows_g = torch.zeros(groups + 1, dtype=torch.float64, device=x2d.device)
        rows_g = rows_g.index_add(0, seg, torch.ones(rows, dtype=torch.float64, device=x2d.device))
        out[:, :2] -= (pad // rows * rows_g[:groups]).unsqueeze(1)
    return out


def expert_tile_partial_stats(w: torch.Tensor, layout: str, fmt: str | FP8Format) -> torch.Tensor:
    """Partials ``[E, PARTIAL_SIZE]`` of each expert's slice ``w[e]`` of ``w [E, R, C]`` under
    ``layout``, each judged on its own: a row layout by :func:`segment_block_partial_stats`, a tile
    layout (``block128x128``) on every expert's ``[R, C]`` zero-padded to whole tiles (a tile never
    holds two experts' weights; the padding out of the counts)."""
    e, r, c = w.shape
    size, tiles, _ = BLOCK_LAYOUTS[layout]
    if not tiles:
        seg = torch.arange(e, device=w.device).repeat_interleave(r)
        return segment_block_partial_stats(w.reshape(e * r, c), seg, e, layout, fmt)
    fmt = get_format(fmt)
    pr, pc = (-r) % size, (-c) % size
    padded = torch.nn.functional.pad(w.detach().to(torch.float32), (0, pc, 0, pr))
    rt, ct = (r + pr) // size, (c + pc) // size
    # [E, rt, size, ct, size] -> one tile per row, experts' tiles contiguous
    tiles_ = padded.reshape(e, rt, size, ct, size).permute(0, 1, 3, 2, 4).reshape(e * rt * ct, size * size)
    _, scale = block_scales(tiles_, layout, fmt)
    seg = torch.arange(e, device=w.device).repeat_interleave(rt * ct)
    out = segment_partial_stats(tiles_, seg, e, fmt, row_scale=scale.reshape(-1))
    out[:, :2] -= float((r + pr) * (c + pc) - r * c)
    return out


def merge_group_partials(partials: torch.Tensor) -> torch.Tensor:
    """One partial of all groups ``[G, PARTIAL_SIZE] -> [PARTIAL_SIZE]``: sums add, maxima take the
    max (the aggregate row of an expert group, merged as shards of one tensor are)."""
    return torch.cat([partials[:, :NUM_SUM].sum(dim=0), partials[:, NUM_SUM:].amax(dim=0)])
