"""Statistics partials of many tensors at once: the row groups of one 2-D tensor, or a list of
tensors laid out as such groups (:func:`tensors_partial_stats`: every tensor a hook phase observed).

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
from collections.abc import Sequence

import torch

from fp8track.numerics.formats import FP8Format, get_format
from fp8track.numerics.kernel_policy import compiled_row_extrema, compiled_row_sums, row_extrema
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


def _group_scales(
    amax_g: torch.Tensor, fconst: torch.Tensor, scale: torch.Tensor | None, current: torch.Tensor | None
) -> torch.Tensor:
    """Each group's scale: ``scale``'s entry, or current scaling where ``scale`` is None or
    ``current`` is set (``M / amax_g / 2**margin`` with Transformer Engine's guards)."""
    if scale is None:
        return scale_from_amax(amax_g, fconst[0], fconst[1])
    s_g = scale.to(device=amax_g.device, dtype=torch.float32).reshape(amax_g.shape)
    if current is None:
        return s_g
    return torch.where(current, scale_from_amax(amax_g, fconst[0], fconst[1]), s_g)


@torch.no_grad()
def segment_partial_stats(
    x2d: torch.Tensor,
    seg: torch.Tensor,
    groups: int,
    fmt: str | FP8Format,
    scale: torch.Tensor | None = None,
    margin: int = 0,
    row_scale: torch.Tensor | None = None,
    current: torch.Tensor | None = None,
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
        current: ``[G]`` bool, with ``scale``: these groups take current scaling instead.
    """
    fmt = get_format(fmt)
    x2d = x2d.detach()
    dev = x2d.device
    rows, width = x2d.shape
    fconst = _fmt_consts(fmt, margin, dev)
    x32 = x2d.to(torch.float32)
    if width:
        extrema = compiled_row_extrema(x32)  # one fused pass where the policy compiles
        row_amax, row_amin = (row_extrema(x32) if extrema is None else extrema).unbind(1)
    else:
        row_amax = x32.new_zeros(rows)
        row_amin = x32.new_full((rows,), math.inf)
    amax_g = _segment_reduce(row_amax, seg, groups, "amax", 0.0)
    amin_g = _segment_reduce(row_amin, seg, groups, "amin", math.inf)
    s_g = _group_scales(amax_g, fconst, scale, current)
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


_LAYOUTS: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
_ZEROS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
_MAX_LAYOUTS = 64


def _layout(
    device: torch.device, width: int, sizes: tuple[int, ...], current: tuple[bool, ...] | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Group index per row, padding zeros per group (float64) and the current-scaling mask of one
    layout, built on the host once and cached: a model observes the same shapes every sampled step,
    so the device never waits for a host-to-device copy after the first."""
    key = (device, width, sizes, current)
    hit = _LAYOUTS.get(key)
    if hit is None:
        rows = [-(-n // width) for n in sizes]
        seg = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(rows))
        pad = torch.tensor([r * width - n for r, n in zip(rows, sizes, strict=True)], dtype=torch.float64)
        mask = None if current is None else _to_device(torch.tensor(current), device)
        if len(_LAYOUTS) >= _MAX_LAYOUTS:
            _LAYOUTS.clear()
        hit = _LAYOUTS[key] = (_to_device(seg, device), _to_device(pad, device), mask)
    return hit


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``; to a GPU from pinned memory, without waiting for the copy."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _zeros(device: torch.device, dtype: torch.dtype, n: int) -> torch.Tensor:
    z = _ZEROS.get((device, dtype))
    if z is None or z.numel() < n:
        z = _ZEROS[(device, dtype)] = torch.zeros(max(n, 1024), dtype=dtype, device=device)
    return z[:n]


def row_width(sizes: Sequence[int]) -> int:
    """The row length :func:`tensors_partial_stats` lays tensors out with: 1024 (the compiled
    kernel's rows), or the next power of two above the largest tensor when all are smaller (tiny
    tensors are not padded to 1024)."""
    largest = max(sizes, default=1)
    return 1024 if largest >= 1024 else 1 << max(largest - 1, 0).bit_length()


@torch.no_grad()
def tensors_partial_stats(
    xs: Sequence[torch.Tensor],
    fmt: str | FP8Format,
    scales: Sequence[torch.Tensor | None] | None = None,
    margin: int = 0,
) -> torch.Tensor:
    """Partials ``[len(xs), PARTIAL_SIZE]`` of many tensors in one pass, each judged on its own, as
    :func:`fp8track.numerics.stats.partial_stats` judges it: with its entry of ``scales`` (a 0-d
    float32 tensor) or, where that is ``None`` (or ``scales`` is), current scaling from its own amax.

    The tensors (non-empty, floating point, on one device) are flattened and laid out as rows of
    :func:`row_width` elements, each tensor zero-padded to whole rows (the padding out of the
    counts), and reduced as the row groups of :func:`segment_partial_stats`: one launch of each
    operation for the whole list, no host synchronisation. Per-element maths and float64
    accumulation are the eager kernel's: a tensor of one row equals its eager partial bit for bit;
    longer ones to float64 summation order (and the compiled kernel's float32 row sums to float32
    rounding, as the eager and compiled paths always differed).
    """
    dev = xs[0].device
    sizes = tuple(x.numel() for x in xs)
    width = row_width(sizes)
    parts: list[torch.Tensor] = []
    for x, n in zip(xs, sizes, strict=True):
        parts.append(x.reshape(-1))
        if n % width:
            parts.append(_zeros(dev, x.dtype, width - n % width))
    flat = torch.cat(parts) if len(parts) > 1 else parts[0]
    given = None if scales is None or all(s is None for s in scales) else scales
    current = None if given is None else tuple(s is None for s in given)
    seg, pad, mask = _layout(dev, width, sizes, current)
    stacked = None
    if given is not None:
        one = torch.ones((), dtype=torch.float32, device=dev)
        stacked = torch.stack([one if s is None else s.reshape(()).to(torch.float32) for s in given])
    out = segment_partial_stats(
        flat.view(-1, width), seg, len(xs), fmt, stacked, margin, current=mask
    )
    out[:, :2] -= pad.unsqueeze(1)
    return out
