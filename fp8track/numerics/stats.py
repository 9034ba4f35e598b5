"""Quantisation statistics of one tensor (docs/statistics.md), computed once and mergeable.

Public entry point: :func:`quant_stats`. Underneath, the statistics are carried as *partials*:
one small float64 tensor per tensor observed, living on that tensor's device, built without any
host synchronisation (:func:`partial_stats`). Partials of micro-batches or ranks combine exactly
(:func:`merge_partials`, :func:`all_reduce_partials`); :func:`finalize` turns them into numbers
on the host, once per logging step. Which path computes a partial (eager, compiled per row length,
ahead of time) is :mod:`fp8track.numerics.kernel_policy`'s choice (:func:`set_compile`, re-exported
here); every path gives the same numbers.

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
current_scale       M / amax / 2^margin in float32 (1.0 when amax is 0, as TE keeps its initial scale)
scale_drift_log2    log2(scale / current_scale)
nonfinite_pct       100 * count(NaN or inf) / numel
numel               element count, non-finite elements included
zero_pct            100 * (N - nnz(x)) / N: exact zeros of the input (post-ReLU activations,
                    padding), so that ``underflow_pct`` can be read against the nonzero elements
=================== ============================================================================
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import torch

from fp8track.errors import ConfigError, invalid_choice
from fp8track.numerics.formats import FP8Format, get_format
from fp8track.numerics.kernel_policy import (  # noqa: F401  (the policy's controls, re-exported where they lived)
    _POLICY,
    COMPILE_MIN_NUMEL,
    COMPILE_MODES,
    KERNEL_ENV,
    MAX_ROWS,
    _CompilePolicy,
    compiled_partial,
    get_compile,
    row_length,
    set_compile,
    wait_for_aot_kernels,
    wants_compiled,
)
from fp8track.numerics.nvfp4 import (
    NVFP4Options,
    columnwise_operand,
    nvfp4_quantize,
    random_hadamard_transform,
)
from fp8track.numerics.scaling import (
    BLOCK_LAYOUTS,
    block_scales,
    blockify,
    drift_log2,
    scale_from_amax,
)
from fp8track.numerics.stats_kernel import (  # noqa: F401  (MAX_FIELDS, SUM_FIELDS, OVERFLOW_RTOL: the partial layout, re-exported)
    _IDX,
    MAX_FIELDS,
    NUM_SUM,
    OVERFLOW_RTOL,
    PARTIAL_FIELDS,
    PARTIAL_SIZE,
    SUM_FIELDS,
    _fmt_consts,
    _merge_two,
    _tensor_partial_body,
    empty_partial,
)

STAT_NAMES: tuple[str, ...] = (
    "amax", "amin", "dynamic_range_log2", "underflow_pct", "overflow_pct", "mse", "cos", "sqnr_db",
    "scale", "current_scale", "scale_drift_log2", "nonfinite_pct", "numel", "zero_pct",
)
"""Every statistic :func:`quant_stats` returns, in a fixed order."""

BLOCK_RECIPES = tuple(BLOCK_LAYOUTS)
"""Block layouts :func:`block_quant_stats` accepts (the table lives in :mod:`fp8track.numerics.scaling`)."""

def _assemble(body: torch.Tensor, numel: int, pad: int) -> torch.Tensor:
    """Prepend ``numel`` (padding excluded) and remove ``pad`` padding zeros from the finite count."""
    head = torch.full((1,), float(numel), dtype=torch.float64, device=body.device)
    if pad:
        body = body.clone()
        body[0] -= pad
    return torch.cat([head, body])


def _remove_padding(partial: torch.Tensor, pad: int) -> torch.Tensor:
    """Take ``pad`` zero elements of padding out of the element and finite counts."""
    fix = torch.zeros(PARTIAL_SIZE, dtype=torch.float64, device=partial.device)
    fix[:2] = pad
    return partial - fix


@functools.cache
def identity_partial(device: torch.device) -> torch.Tensor:
    """A cached :func:`empty_partial` on ``device``: read only (the kernel merges into it and returns a
    new tensor; stacking copies it)."""
    return empty_partial(device)


def _as_scale(scale: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    if isinstance(scale, torch.Tensor) and scale.dtype == torch.float32 and scale.device == device:
        return scale  # the common case (a backend's scale tensor), without as_tensor's dispatch
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
    into: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mergeable partial sums of ``x`` quantised to ``fmt`` with ``scale``; no host sync.

    Args:
        x: any float tensor, any shape, any device (detached; safe inside autograd hooks).
        fmt: ``"e4m3"`` or ``"e5m2"``.
        scale: the scale used (a scalar, or a tensor broadcasting against ``x`` for block
            scales); ``None`` means current scaling (computed on the device from the finite amax).
        margin: exponent margin of current scaling (only used when ``scale`` is None).
        pad: number of zero elements in ``x`` that are padding (block views), removed from the counts.
        into: an accumulator partial to merge the result into (micro-batches of one step); the
            compiled kernel merges in the same call. ``into`` itself is not modified.

    Returns:
        float64 tensor of shape ``[PARTIAL_SIZE]`` on ``x``'s device (layout: :data:`PARTIAL_FIELDS`):
        the partial of ``x``, merged with ``into`` when given (a new tensor).
    """
    fmt = get_format(fmt)
    if fmt.name == "e2m1":
        raise ConfigError(
            "format 'e2m1' is NVFP4's: use nvfp4_partial_stats (two-level scales), not partial_stats"
        )
    x = x.detach()
    n = x.numel()
    s = None if scale is None else _as_scale(scale, x.device)
    if n == 0:
        p = empty_partial(x.device)
        if s is not None:
            p[_IDX["scale_max"]] = s.amax().to(torch.float64) if s.numel() else -math.inf
            p[_IDX["neg_scale_min"]] = (-s.amin()).to(torch.float64) if s.numel() else -math.inf
        return p if into is None else _merge_two(into, p)
    fconst = _fmt_consts(fmt, margin, x.device)
    use_current = _flag(s is None, x.device)
    if s is None:
        s = _ignored_scale(x.device)  # a 0-d float32 placeholder, ignored under current scaling
    if s.numel() == 1 and wants_compiled(x):
        acc = identity_partial(x.device) if into is None else into
        compiled = compiled_partial(x, acc, s if s.dim() == 0 else s.reshape(()), use_current, fconst)
        if compiled is not None:
            out, tail_pad = compiled
            return _remove_padding(out, pad + tail_pad) if pad + tail_pad else out
    if s.numel() > 1:
        # Block scales broadcast against x: rows are x's leading dims (each block a row).
        if x.dim() == 2:
            x2 = x
        else:
            x2 = x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x.reshape(1, -1)
            s = s.expand(x.shape).reshape(x2.shape)
    else:
        x2, s = x.reshape(1, -1), s.reshape(())
    body = _tensor_partial_body(x2, None, s, use_current, fconst, fmt.dtype)
    out = _assemble(body, n - pad, pad)
    return out if into is None else _merge_two(into, out)


@functools.cache
def _flag(value: bool, device: torch.device) -> torch.Tensor:
    """A cached 0-d bool tensor on ``device`` (built once: a host-to-device copy per call would be
    a copy per observed tensor on a GPU)."""
    return torch.tensor(value, device=device)


@functools.cache
def _ignored_scale(device: torch.device) -> torch.Tensor:
    """A cached 0-d float32 tensor on ``device``: the scale argument under current scaling."""
    return torch.ones((), dtype=torch.float32, device=device)


def merge_partials(partials: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """Combine partials along the first dimension: sums add, maxima take the max.

    Accepts a sequence of ``[..., PARTIAL_SIZE]`` tensors or one stacked tensor ``[n, ..., PARTIAL_SIZE]``.
    """
    stacked = torch.stack(list(partials)) if not isinstance(partials, torch.Tensor) else partials
    return torch.cat([stacked[..., :NUM_SUM].sum(0), stacked[..., NUM_SUM:].amax(0)], dim=-1)


def all_reduce_partials(
    partials: torch.Tensor, group: Any = None, timeout_s: float | None = None
) -> torch.Tensor:
    """Reduce ``[..., PARTIAL_SIZE]`` partials over all ranks of ``group`` (one SUM, one MAX collective).

    Every rank must call this with the same shape. Returns the merged tensor (a new tensor).
    With ``timeout_s``, waits at most that long (see :func:`wait_collectives`).
    """
    import torch.distributed as dist

    sums = partials[..., :NUM_SUM].contiguous()
    maxes = partials[..., NUM_SUM:].contiguous()
    works = [
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group, async_op=True),
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group, async_op=True),
    ]
    wait_collectives(works, timeout_s, "the statistics all-reduce")
    return torch.cat([sums, maxes], dim=-1)


def wait_collectives(works: Sequence[Any], timeout_s: float | None, what: str) -> None:
    """Wait for async collectives, at most ``timeout_s`` seconds each (None: the process group's
    own timeout). A peer that died (gloo: connection reset) or stopped answering raises
    :class:`fp8track.errors.RankFailure` naming ``what``, this rank and the wait."""
    import datetime

    import torch.distributed as dist

    from fp8track.errors import RankFailure

    for work in works:
        try:
            if timeout_s is None:
                work.wait()
            else:
                work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            rank = dist.get_rank() if dist.is_initialized() else 0
            raise RankFailure(
                f"fp8track: rank {rank} gave up on {what} after waiting at most {timeout_s} s: another rank "
                f"failed, died or stopped answering ({str(exc).splitlines()[0][:300]}). The run stops here "
                "rather than hang; look at the other ranks' logs for the first error"
            ) from exc


def finalize(
    partial: torch.Tensor | Sequence[float], fmt: str | FP8Format = "e4m3", margin: int = 0
) -> dict[str, float]:
    """Turn one partial (a ``[PARTIAL_SIZE]`` tensor or list) into the statistics dict on the host."""
    return finalize_many(torch.as_tensor(partial, dtype=torch.float64).reshape(1, -1), [fmt], margin)[0]


def finalize_many(
    partials: torch.Tensor | Sequence[Sequence[float]],
    fmts: Sequence[str | FP8Format],
    margin: int | Sequence[int] = 0,
) -> list[dict[str, float]]:
    """Finalize stacked partials ``[n, PARTIAL_SIZE]`` (a tensor or host lists) with one host copy.

    ``margin`` is one for all rows or one per row. ``current_scale`` comes from
    :func:`fp8track.numerics.scaling.scale_from_amax` (float32, as the backends compute it), for
    all rows in one call: finalize many rows at once rather than one :func:`finalize` per row.
    """
    formats = [get_format(f) for f in fmts]
    host = _host_rows(partials, len(formats))
    margins = [margin] * len(formats) if isinstance(margin, int) else list(margin)
    amax_col = torch.tensor([row[_IDX["amax"]] for row in host], dtype=torch.float64)
    amaxes = amax_col.clamp(min=0.0).to(torch.float32)
    fmt_max = torch.tensor([f.max for f in formats], dtype=torch.float32)
    factor = torch.tensor([2.0**-m for m in margins], dtype=torch.float32)
    currents = scale_from_amax(amaxes, fmt_max, factor).tolist()
    return [_finalize_row(row, cur) for row, cur in zip(host, currents, strict=True)]


def _host_rows(partials: torch.Tensor | Sequence[Sequence[float]], n: int) -> list[list[float]]:
    """``[n, PARTIAL_SIZE]`` partials as host lists of float64 values: a tensor with one host copy;
    host lists (a flush's copy) as they are, without building a tensor from nested lists (slow)."""
    if not isinstance(partials, torch.Tensor) and len(partials) == n:
        rows = [[float(v) for v in p] for p in partials]
        if all(len(r) == PARTIAL_SIZE for r in rows):
            return rows
    out = torch.as_tensor(partials, dtype=torch.float64).detach().cpu().reshape(n, PARTIAL_SIZE)
    return out.tolist()


assert PARTIAL_FIELDS == ("numel", "n_finite", "nnz_x", "nnz_d", "n_overflow", "sum_x2", "sum_d2", "sum_xd",
                          "sum_err2", "amax", "neg_amin", "scale_max", "neg_scale_min")  # _finalize_row order


def _finalize_row(p: Sequence[float], cur: float) -> dict[str, float]:
    numel, n, nnz_x, nnz_d, n_overflow, sum_x2, sum_d2, sum_xd, sum_err2, amax, neg_amin, _, neg_scale_min = p
    amax_v = max(amax, 0.0)
    amin_v = -neg_amin
    if not math.isfinite(amin_v):
        amin_v = 0.0
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
    scale = -neg_scale_min
    if not math.isfinite(scale) and n == 0:
        scale = cur
    return {
        "amax": amax_v,
        "amin": amin_v,
        "dynamic_range_log2": math.log2(amax_v) - math.log2(amin_v) if amin_v > 0 else 0.0,
        "underflow_pct": 100.0 * (nnz_x - nnz_d) / n if n else 0.0,
        "overflow_pct": 100.0 * n_overflow / n if n else 0.0,
        "mse": sum_err2 / n if n else 0.0,
        "cos": cos,
        "sqnr_db": sqnr,
        "scale": scale,
        "current_scale": cur,
        "scale_drift_log2": drift_log2(scale, cur),
        "nonfinite_pct": 100.0 * (numel - n) / numel if numel else 0.0,
        "numel": numel,
        "zero_pct": 100.0 * (n - nnz_x) / n if n else 0.0,
    }


def quant_stats(
    x: torch.Tensor,
    fmt: str | FP8Format = "e4m3",
    scale: torch.Tensor | float | None = None,
    margin: int = 0,
) -> dict[str, float]:
    """All statistics of docs/statistics.md for ``x`` quantised to ``fmt`` with a per-tensor ``scale``.

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
def block_partial_stats(
    x: torch.Tensor, recipe: str, fmt: str | FP8Format = "e4m3", power_2_scales: bool = True
) -> torch.Tensor:
    """Partials for a block-scaled recipe, each block with its own scale (no host sync).

    Recipes: ``"mxfp8"`` (1 x 32 blocks along the last dim, E8M0 scales rounded up as TE does),
    ``"block128"`` (1 x 128, power-of-two scales), ``"block128x128"`` (128 x 128 tiles of a 2-D
    tensor, power-of-two scales). Padding of partial blocks is excluded from the counts.
    ``power_2_scales=False`` gives the 128-block recipes plain float32 scales ``fmt.max / amax``
    (TE's ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1``); MXFP8 scales are always powers of two.
    """
    fmt = get_format(fmt)
    if recipe not in BLOCK_RECIPES:
        raise invalid_choice("block recipe", recipe, BLOCK_RECIPES)
    blocks, pad = blockify(x.detach().to(torch.float32), recipe)
    block_amax, scale = block_scales(blocks, recipe, fmt, power_2_scales)
    # Only blocks holding data decide the reported scale range (empty blocks get arbitrary scales).
    p = partial_stats(blocks, fmt, scale, pad=pad)
    # An all-zero tensor has no occupied block: then every block's scale counts.
    occupied = block_amax.reshape(-1) > 0
    if occupied.numel():
        occupied = occupied | ~occupied.any()
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


_ROWWISE = NVFP4Options()


@torch.no_grad()
def nvfp4_partial_stats(
    x: torch.Tensor,
    options: NVFP4Options = _ROWWISE,
    columnwise: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Partial of ``x`` quantised to NVFP4 as TE does (:mod:`fp8track.numerics.nvfp4`); eager, no
    host sync. Finalize it with format ``"e2m1"``.

    The statistics describe the operand the GEMM multiplies: with ``columnwise`` the transposed
    copy (blocks along the token dimension, the wgrad operand), with ``options.rht`` after the
    Hadamard transform. ``underflow_pct`` counts non-zero elements whose E2M1 code is 0, as TE's
    ``count_nonzero_nvfp4`` does (a block whose E4M3 scale itself underflows keeps non-zero codes
    but dequantises to 0: ``mse``/``cos`` show it); ``overflow_pct`` counts ``|x * e_b| > 6``
    (clipped by an E4M3 scale rounded down); ``scale`` is the block encode scale ``e_b`` (its min
    and max over blocks holding data), so ``scale_drift_log2`` against ``6 / amax`` is ~0.
    """
    x = x.detach()
    numel = x.numel()
    finite = torch.isfinite(x)
    if columnwise:
        operand = columnwise_operand(torch.where(finite, x, 0), options.rht)
        options = dataclasses.replace(options, rht=False)
    else:
        operand = x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x.reshape(1, -1)
    p = empty_partial(x.device)
    if numel == 0:
        return p
    q = nvfp4_quantize(operand, options, generator)
    xo = random_hadamard_transform(_finite_f32(operand)) if options.rht else _finite_f32(operand)
    absx = xo.abs()
    amax = absx.amax()
    # Products on values normalised by a power of two (no float32 overflow near 3e38), summed per
    # row in float32, rows in float64, as the fused kernel does (stats_kernel.py).
    mant, exp = torch.frexp(amax)
    norm = torch.where(amax > 0, torch.exp2(-exp.to(torch.float32)), torch.ones_like(amax))
    xn, dn = xo * norm, q.dequantized * norm
    inv2 = (1.0 / norm.to(torch.float64)) ** 2

    def total(v: torch.Tensor) -> torch.Tensor:
        return v.sum(dim=-1).to(torch.float64).sum() * inv2

    occupied = q.decode_scales > 0
    occupied = occupied | ~occupied.any()
    p[_IDX["numel"]] = numel
    p[_IDX["n_finite"]] = finite.sum()
    p[_IDX["nnz_x"]] = (xo != 0).sum()
    p[_IDX["nnz_d"]] = (q.codes != 0).sum()
    p[_IDX["n_overflow"]] = q.clipped
    p[_IDX["sum_x2"]] = total(xn * xn)
    p[_IDX["sum_d2"]] = total(dn * dn)
    p[_IDX["sum_xd"]] = total(xn * dn)
    p[_IDX["sum_err2"]] = total((xn - dn).square())
    p[_IDX["amax"]] = amax
    p[_IDX["neg_amin"]] = -torch.where(absx > 0, absx, math.inf).amin()
    enc = q.encode_scales
    p[_IDX["scale_max"]] = torch.where(occupied, enc, -math.inf).amax()
    p[_IDX["neg_scale_min"]] = -torch.where(occupied, enc, math.inf).amin()
    return p


def _finite_f32(x: torch.Tensor) -> torch.Tensor:
    x = x.to(torch.float32)
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def nvfp4_quant_stats(
    x: torch.Tensor, options: NVFP4Options = _ROWWISE, columnwise: bool = False,
    generator: torch.Generator | None = None,
) -> dict[str, float]:
    """:func:`quant_stats` for NVFP4 (see :func:`nvfp4_partial_stats`); ``current_scale`` is
    ``6 / amax``."""
    return finalize(nvfp4_partial_stats(x, options, columnwise, generator), "e2m1")
