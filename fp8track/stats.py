"""Quantisation statistics of one tensor (DESIGN.md section 4), computed once and mergeable.

Public entry point: :func:`quant_stats`. Underneath, the statistics are carried as *partials*:
one small float64 tensor per tensor observed, living on that tensor's device, built without any
host synchronisation (:func:`partial_stats`). Partials of micro-batches or ranks combine exactly
(:func:`merge_partials`, :func:`all_reduce_partials`); :func:`finalize` turns them into numbers
on the host, once per logging step.

Definitions (x upcast to float32, non-finite elements set aside; N = number of finite elements,
``d = saturating_cast(x * s) / s``, M = the format's max):

=================== ============================================================================
amax                max |x|
amin                min |x| over nonzero x (0 when there is none)
dynamic_range_log2  log2(amax) - log2(amin) (0 when amin is 0)
underflow_pct       100 * (nnz(x) - nnz(d)) / N
overflow_pct        100 * count(|x * s| > M) / N, counted before the cast (never from its result)
mse                 sum((x - d)^2) / N
cos                 sum(x d) / (|x| |d|); 1 when both norms are 0, 0 when exactly one is
sqnr_db             10 log10(sum(x^2) / sum((x - d)^2)); +inf when the error is 0
scale               the scale used (for several merged parts: the smallest; for block recipes:
                    the smallest block scale, i.e. that of the block holding amax)
current_scale       M / amax / 2^margin (1.0 when amax is 0, as TE keeps its initial scale)
scale_drift_log2    log2(scale / current_scale)
nonfinite_pct       100 * count(NaN or inf) / numel
numel               element count, non-finite elements included
=================== ============================================================================
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from fp8track.errors import ConfigError, invalid_choice
from fp8track.formats import FP8Format, get_format
from fp8track.scaling import (
    blockify_rows,
    blockify_tiles,
    current_scale,
    mx_block_scales,
    pow2_block_scales,
)

STAT_NAMES: tuple[str, ...] = (
    "amax",
    "amin",
    "dynamic_range_log2",
    "underflow_pct",
    "overflow_pct",
    "mse",
    "cos",
    "sqnr_db",
    "scale",
    "current_scale",
    "scale_drift_log2",
    "nonfinite_pct",
    "numel",
)
"""Every statistic :func:`quant_stats` returns, in a fixed order."""

# Partial layout: fields merged by summation first, then fields merged by max. Minimums are
# stored negated so that a single MAX reduction serves them (one SUM + one MAX all-reduce total).
SUM_FIELDS: tuple[str, ...] = ("numel", "n_finite", "nnz_x", "nnz_d", "n_overflow", "sum_x2", "sum_d2", "sum_xd", "sum_err2")
MAX_FIELDS: tuple[str, ...] = ("amax", "neg_amin", "scale_max", "neg_scale_min")
PARTIAL_FIELDS: tuple[str, ...] = SUM_FIELDS + MAX_FIELDS
NUM_SUM = len(SUM_FIELDS)
PARTIAL_SIZE = len(PARTIAL_FIELDS)
_IDX = {name: i for i, name in enumerate(PARTIAL_FIELDS)}

BLOCK_RECIPES = ("mxfp8", "block128", "block128x128")
OVERFLOW_RTOL = 1.0 + 2.0**-22
"""An element overflows when ``|x * s| > M * OVERFLOW_RTOL`` (float32 rounding allowance)."""


def empty_partial(device: torch.device | str | None = None) -> torch.Tensor:
    """The identity element of :func:`merge_partials` (zero sums, -inf maxima)."""
    p = torch.zeros(PARTIAL_SIZE, dtype=torch.float64, device=device)
    p[NUM_SUM:] = -math.inf
    return p


def _partial_impl(x: torch.Tensor, scale: torch.Tensor, fmt_max: float, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Fused body of :func:`partial_stats`; ``scale`` broadcasts against ``x`` (float32)."""
    x = x.to(torch.float32)
    finite = torch.isfinite(x)
    xf = torch.where(finite, x, 0.0)
    a = xf.abs()
    # x == 0 must stay 0 even for an infinite scale (0 * inf is NaN).
    xs = torch.where(xf == 0, 0.0, xf * scale)
    # The tolerance absorbs float32 rounding of scale * amax (a current scale M / amax can give
    # amax * scale = M + 1 ulp); such an element rounds to M in FP8 and loses nothing to clipping.
    n_overflow = (xs.abs() > fmt_max * OVERFLOW_RTOL).sum(dtype=torch.float64)
    q = xs.clamp(-fmt_max, fmt_max).to(fp8_dtype).to(torch.float32)
    # q == 0 must dequantise to 0 even for a zero scale (0 / 0 is NaN).
    d = torch.where(q == 0, 0.0, q / scale)
    err = xf - d
    f64 = torch.float64
    sums = torch.stack(
        [
            torch.tensor(float(x.numel()), dtype=f64, device=x.device),
            finite.sum(dtype=f64),
            (xf != 0).sum(dtype=f64),
            (d != 0).sum(dtype=f64),
            n_overflow,
            (xf * xf).sum(dtype=f64),
            (d * d).sum(dtype=f64),
            (xf * d).sum(dtype=f64),
            (err * err).sum(dtype=f64),
        ]
    )
    amax_v = a.amax() if a.numel() else a.new_zeros(())
    amin_v = torch.where(a > 0, a, math.inf).amin() if a.numel() else a.new_full((), math.inf)
    s = scale.to(torch.float32)
    maxes = torch.stack([amax_v, -amin_v, s.amax(), -s.amin()]).to(f64)
    return torch.cat([sums, maxes])


def _as_scale(scale: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(scale, dtype=torch.float32, device=device)


def check_scale(scale: torch.Tensor | float) -> None:
    """Reject a negative or NaN scale (a host check: call it outside hot paths)."""
    s = torch.as_tensor(scale, dtype=torch.float32)
    if bool(torch.isnan(s).any()) or bool((s < 0).any()):
        raise ConfigError(f"scale must be >= 0 and not NaN (0 and inf are allowed), got {scale!r}")


@torch.no_grad()
def partial_stats(
    x: torch.Tensor,
    fmt: str | FP8Format = "e4m3",
    scale: torch.Tensor | float | None = None,
    margin: int = 0,
    pad: int = 0,
) -> torch.Tensor:
    """Mergeable partial sums of ``x`` quantised to ``fmt`` with ``scale``; no host sync.

    Args:
        x: any float tensor, any shape, any device.
        fmt: ``"e4m3"`` or ``"e5m2"``.
        scale: the scale used (a scalar, or a tensor broadcasting against ``x`` for block
            scales); ``None`` means current scaling (computed on the device from the finite amax).
        margin: exponent margin of current scaling (only used when ``scale`` is None).
        pad: number of zero elements in ``x`` that are padding (block views), removed from the counts.

    Returns:
        float64 tensor of shape ``[PARTIAL_SIZE]`` on ``x``'s device (layout: :data:`PARTIAL_FIELDS`).
    """
    fmt = get_format(fmt)
    x = x.detach()
    if scale is None:
        xf = x.to(torch.float32)
        finite_amax = torch.where(torch.isfinite(xf), xf.abs(), 0.0).amax() if xf.numel() else xf.new_zeros(())
        s = current_scale(finite_amax, fmt, margin)
    else:
        s = _as_scale(scale, x.device)
    p = _partial_impl(x, s, fmt.max, fmt.dtype)
    if pad:
        p[_IDX["numel"]] -= pad
        p[_IDX["n_finite"]] -= pad
    return p


def merge_partials(partials: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """Combine partials along the first dimension: sums add, maxima take the max.

    Accepts a sequence of ``[..., PARTIAL_SIZE]`` tensors or one stacked tensor ``[n, ..., PARTIAL_SIZE]``.
    """
    stacked = torch.stack(list(partials)) if not isinstance(partials, torch.Tensor) else partials
    return torch.cat([stacked[..., :NUM_SUM].sum(0), stacked[..., NUM_SUM:].amax(0)], dim=-1)


def all_reduce_partials(partials: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Reduce ``[..., PARTIAL_SIZE]`` partials over all ranks of ``group`` (one SUM, one MAX collective).

    Every rank must call this with the same shape. Returns the merged tensor (a new tensor).
    """
    import torch.distributed as dist

    sums = partials[..., :NUM_SUM].contiguous()
    maxes = partials[..., NUM_SUM:].contiguous()
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
    return torch.cat([sums, maxes], dim=-1)


def _safe_log2(v: float) -> float:
    if v == 0:
        return -math.inf
    return math.log2(v) if math.isfinite(v) else math.inf


def finalize(partial: torch.Tensor | Sequence[float], fmt: str | FP8Format = "e4m3", margin: int = 0) -> dict[str, float]:
    """Turn one partial (a ``[PARTIAL_SIZE]`` tensor or list) into the statistics dict on the host."""
    fmt = get_format(fmt)
    p = partial.detach().cpu().tolist() if isinstance(partial, torch.Tensor) else list(partial)
    v = dict(zip(PARTIAL_FIELDS, p, strict=True))
    numel, n = v["numel"], v["n_finite"]
    amax_v = max(v["amax"], 0.0)
    amin_v = -v["neg_amin"]
    if not math.isfinite(amin_v):
        amin_v = 0.0
    sum_x2, sum_d2, sum_xd, sum_err2 = v["sum_x2"], v["sum_d2"], v["sum_xd"], v["sum_err2"]
    if sum_x2 == 0 and sum_d2 == 0:
        cos = 1.0
    elif sum_x2 == 0 or sum_d2 == 0:
        cos = 0.0
    else:
        cos = max(-1.0, min(1.0, sum_xd / math.sqrt(sum_x2 * sum_d2)))
    if sum_err2 == 0:
        sqnr = math.inf
    elif sum_x2 == 0:
        sqnr = -math.inf
    else:
        sqnr = 10.0 * math.log10(sum_x2 / sum_err2)
    cur = fmt.max / amax_v / 2.0**margin if amax_v > 0 else 1.0
    cur = min(cur, torch.finfo(torch.float32).max)
    scale = -v["neg_scale_min"]
    if not math.isfinite(scale) and n == 0:
        scale = cur
    if scale > 0 and math.isfinite(scale):
        drift = math.log2(scale) - math.log2(cur)
    else:
        drift = _safe_log2(scale)
    return {
        "amax": amax_v,
        "amin": amin_v,
        "dynamic_range_log2": math.log2(amax_v) - math.log2(amin_v) if amin_v > 0 else 0.0,
        "underflow_pct": 100.0 * (v["nnz_x"] - v["nnz_d"]) / n if n else 0.0,
        "overflow_pct": 100.0 * v["n_overflow"] / n if n else 0.0,
        "mse": sum_err2 / n if n else 0.0,
        "cos": cos,
        "sqnr_db": sqnr,
        "scale": scale,
        "current_scale": cur,
        "scale_drift_log2": drift,
        "nonfinite_pct": 100.0 * (numel - n) / numel if numel else 0.0,
        "numel": numel,
    }


def finalize_many(partials: torch.Tensor, fmts: Sequence[str | FP8Format], margin: int = 0) -> list[dict[str, float]]:
    """Finalize stacked partials ``[n, PARTIAL_SIZE]`` with one host copy."""
    rows = partials.detach().cpu().tolist()
    return [finalize(row, fmt, margin) for row, fmt in zip(rows, fmts, strict=True)]


def quant_stats(
    x: torch.Tensor,
    fmt: str | FP8Format = "e4m3",
    scale: torch.Tensor | float | None = None,
    margin: int = 0,
) -> dict[str, float]:
    """All statistics of DESIGN.md section 4 for ``x`` quantised to ``fmt`` with a per-tensor ``scale``.

    Args:
        x: any float tensor (any device); it is upcast to float32.
        fmt: ``"e4m3"`` (max 448) or ``"e5m2"`` (max 57344).
        scale: scale used by the recipe; ``None`` = current scaling, ``M / amax / 2**margin``.
            0 and inf are allowed (defined results); negative or NaN raise ``ConfigError``.
        margin: exponent margin of current scaling.

    Returns:
        dict with exactly the keys of :data:`STAT_NAMES`, values as Python floats.

    Example:
        >>> import torch
        >>> s = quant_stats(torch.tensor([1.0, 2.0, 0.0, 1000.0]), "e4m3", scale=1.0)
        >>> s["overflow_pct"], s["underflow_pct"], s["amax"]
        (25.0, 0.0, 1000.0)
    """
    fmt = get_format(fmt)
    if scale is not None:
        check_scale(scale)
    return finalize(partial_stats(x, fmt, scale, margin), fmt, margin)


@torch.no_grad()
def block_partial_stats(x: torch.Tensor, recipe: str, fmt: str | FP8Format = "e4m3") -> torch.Tensor:
    """Partials for a block-scaled recipe, each block with its own scale (no host sync).

    Recipes: ``"mxfp8"`` (1 x 32 blocks along the last dim, E8M0 scales rounded up as TE does),
    ``"block128"`` (1 x 128, power-of-two scales), ``"block128x128"`` (128 x 128 tiles of a 2-D
    tensor, power-of-two scales). Padding of partial blocks is excluded from the counts.
    """
    fmt = get_format(fmt)
    if recipe not in BLOCK_RECIPES:
        raise invalid_choice("block recipe", recipe, BLOCK_RECIPES)
    x = x.detach().to(torch.float32)
    if recipe == "block128x128":
        blocks, pad = blockify_tiles(x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x, 128)
    else:
        blocks, pad = blockify_rows(x, 32 if recipe == "mxfp8" else 128)
    finite_abs = torch.where(torch.isfinite(blocks), blocks.abs(), 0.0)
    block_amax = finite_abs.amax(dim=1, keepdim=True)
    if recipe == "mxfp8":
        scale, _codes = mx_block_scales(block_amax, fmt)
    else:
        scale = pow2_block_scales(block_amax, fmt)
    # Only blocks holding data decide the reported scale range (empty blocks get arbitrary scales).
    p = partial_stats(blocks, fmt, scale, pad=pad)
    occupied = block_amax.reshape(-1) > 0
    if bool(occupied.numel()):
        s = scale.reshape(-1)
        big = torch.where(occupied, s, -math.inf).amax()
        small = torch.where(occupied, s, math.inf).amin()
        p[_IDX["scale_max"]] = big.to(torch.float64)
        p[_IDX["neg_scale_min"]] = (-small).to(torch.float64)
    return p


def block_quant_stats(x: torch.Tensor, recipe: str, fmt: str | FP8Format = "e4m3") -> dict[str, float]:
    """:func:`quant_stats` for a block-scaled recipe (see :func:`block_partial_stats`).

    ``scale`` is the smallest block scale and ``current_scale``/``scale_drift_log2`` compare it with
    per-tensor current scaling: a drift of -k means the largest block sits k binades below the
    tensor-wide scale because of power-of-two rounding.
    """
    return finalize(block_partial_stats(x, recipe, fmt), fmt)
