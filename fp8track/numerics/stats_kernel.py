"""The fused statistics kernel: the graph that ``torch.compile`` and AOTInductor compile.

Pure tensor maths, no dispatch: :mod:`fp8track.numerics.stats` decides how a call runs (eager,
``torch.compile``, or an ahead-of-time package from :mod:`fp8track.numerics.aot_kernels`), and
both of those compile :func:`_compiled_partial` from here. Definitions of the statistics:
:mod:`fp8track.numerics.stats` and docs/statistics.md.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fp8track.numerics.formats import FP8Format
from fp8track.numerics.scaling import scale_from_amax

# Partial layout: fields merged by summation first, then fields merged by max. Minimums are
# stored negated so that a single MAX reduction serves them (one SUM + one MAX all-reduce total).
SUM_FIELDS: tuple[str, ...] = (
    "numel",
    "n_finite",
    "nnz_x",
    "nnz_d",
    "n_overflow",
    "sum_x2",
    "sum_d2",
    "sum_xd",
    "sum_err2",
)
MAX_FIELDS: tuple[str, ...] = ("amax", "neg_amin", "scale_max", "neg_scale_min")
PARTIAL_FIELDS: tuple[str, ...] = SUM_FIELDS + MAX_FIELDS
NUM_SUM = len(SUM_FIELDS)
PARTIAL_SIZE = len(PARTIAL_FIELDS)
_IDX = {name: i for i, name in enumerate(PARTIAL_FIELDS)}

OVERFLOW_RTOL = 1.0 + 2.0**-22
"""An element overflows when ``|x * s| > M * OVERFLOW_RTOL`` (float32 rounding allowance)."""


def empty_partial(device: torch.device | str | None = None) -> torch.Tensor:
    """The identity element of :func:`merge_partials` (zero sums, -inf maxima)."""
    p = torch.zeros(PARTIAL_SIZE, dtype=torch.float64, device=device)
    p[NUM_SUM:] = -math.inf
    return p


# --- the fused kernel ------------------------------------------------------------------------------
#
# One code path serves eager and compiled execution. The tensor is seen as rows ``[R, C]`` (block
# recipes: one block per row, per-row scales); statistics are reduced per row, then over rows in
# float64. Two passes over the data are the minimum for current scaling (amax decides the scale);
# a given scale takes the same two passes because amax also fixes the normalisation below.
#
# Products are formed in float32 on values normalised by p = 2**-floor(log2(amax)) (exact: a power of
# two), so squares cannot overflow float32 even for |x| near 3e38; the sums are rescaled by 1/p**2 in
# float64 at the end. Compiled: rows of C elements (:func:`row_length`) summed in float32 (counts
# exact, products to ~C ulp), rows summed in float64. Eager: each row summed directly in float64.
#
# Every reduction is written per row first (``dim=1``), then over rows: the graph fixes the two
# stages itself. Left a single reduction over a dynamic length, inductor chooses how to split it
# from the size it first compiled for, and reuses that choice for every later size.

_CHUNK = 1024
_ROW_FIELDS = SUM_FIELDS[1:]  # numel is known on the host


def _pow2_normaliser(amax_v: torch.Tensor) -> torch.Tensor:
    """``2**(127 - e)`` where ``e`` is the biased float32 exponent of ``amax`` (so ``amax * p < 4``)."""
    biased = ((amax_v.view(torch.int32) >> 23) & 0xFF).clamp(max=253)
    return ((254 - biased) << 23).view(torch.float32)


# Format constants as one float32 device tensor (see _fmt_consts), so one compiled graph serves
# every format and margin: max, 2**-margin, then the three constants of round_to_fp8_grid.
_F_MAX, _F_MARGIN, _F_SPLIT, _F_SUB_MAGIC, _F_MIN_NORMAL = range(5)


def round_to_fp8_grid(v: torch.Tensor, fconst: torch.Tensor) -> torch.Tensor:
    """Round float32 ``v`` (already within ±max) to the nearest FP8 value, ties to even, staying float32.

    Float32 additions and multiplications only, so inductor vectorises it without bit casts (a
    float<->int bit cast is scalar code in inductor's CPU backend and cost 2.4x this whole function):

    * normal range (``|v| >= smallest normal``): Veltkamp-Dekker splitting. With
      ``split = 2**(23 - mantissa_bits)``, ``g = v * split + v`` and ``g + (v - g)`` is ``v`` rounded to
      ``mantissa_bits + 1`` significant bits by the float32 adder's round-half-even. ``v * split`` is
      exact (a power of two), so a fused multiply-add rounds ``g`` the same way.
    * subnormal range: the spacing is fixed (the smallest subnormal ``q``); adding and subtracting
      ``1.5 * 2**23 * q`` rounds ``|v|`` to a multiple of ``q``, half to even; ``copysign`` keeps -0.

    Bit-exact with ``v.to(float8).float()`` (checked on every bfloat16 and float16 value at several
    scales in tests/unit/test_stats.py).

    Args:
        v: float32 tensor with ``|v| <= fmt.max``.
        fconst: the format's constants from :func:`_fmt_consts`.
    """
    g = v * fconst[_F_SPLIT] + v
    normal = g + (v - g)
    magic = fconst[_F_SUB_MAGIC]
    subnormal = torch.copysign((v.abs() + magic) - magic, v)
    return torch.where(v.abs() < fconst[_F_MIN_NORMAL], subnormal, normal)


def _fmt_consts(fmt: FP8Format, margin: int, device: torch.device) -> torch.Tensor:
    """The format's float32 constants on ``device`` (cached): max, ``2**-margin``, and the splitting
    factor, subnormal rounding constant and smallest normal of :func:`round_to_fp8_grid`."""
    key = (fmt.name, margin, device)
    hit = _CONST_CACHE.get(key)
    if hit is None:
        values = [
            fmt.max,
            2.0**-margin,
            2.0 ** (23 - fmt.mantissa_bits),
            1.5 * 2.0**23 * fmt.smallest_subnormal,
            fmt.smallest_normal,
        ]
        hit = _CONST_CACHE[key] = torch.tensor(values, dtype=torch.float32, device=device)
    return hit


_CONST_CACHE: dict[tuple[str, int, torch.device], torch.Tensor] = {}


# The eager pass and the compiled graph spell two things differently, with the same values (the
# eager spellings were checked bit for bit against these on 959 cases when they were introduced):
#   zeroing NaN (and 0 * inf, 0 / 0): eager nan_to_num, since torch.where is an unvectorised eager
#     op on CPU (4-5 ns per element against 0.3); compiled torch.where, since inductor lowers an
#     expression once per path that reaches it in the one inlined loop (_INDUCTOR_OPTIONS), and
#     nan_to_num's decomposition reads its input four times: the first compile of a kernel took
#     42-54 s with it, 13-19 s with where (CPU, empty inductor cache).
#   counting a mask: eager count_nonzero (no float64 copy of the mask); compiled a sum of the mask,
#     fused into the loop, where count_nonzero made the kernel 1.3x slower (524,288 elements).


def _finite_abs(x: torch.Tensor, graph: bool) -> torch.Tensor:
    """``|x|`` in float32 with non-finite elements as 0 (``graph``: the compiled spelling)."""
    xf = x.to(torch.float32)
    if graph:
        return torch.where(torch.isfinite(xf), xf.abs(), 0.0)
    return xf.abs().nan_to_num(0.0, 0.0, 0.0)


def _row_sums(
    x2: torch.Tensor,
    scale: torch.Tensor,
    p: torch.Tensor,
    fconst: torch.Tensor,
    fp8_dtype: torch.dtype | None,
    acc: torch.dtype,
) -> torch.Tensor:
    """Per-row ``[R, len(_ROW_FIELDS)]`` sums of the quantisation of ``x2 [R, C]``
    (products normalised by ``p``).

    ``fp8_dtype`` None rounds with :func:`round_to_fp8_grid` and takes the compiled spellings (see
    above), else rounds with the real cast.
    """
    graph = fp8_dtype is None
    fmt_max = fconst[_F_MAX]
    x = x2.to(torch.float32)
    finite = torch.isfinite(x)
    # x == 0 must stay 0 even for an infinite scale: 0 * inf is the only NaN here (xf is finite).
    if graph:
        xf = torch.where(finite, x, 0.0)
        xs = torch.where(xf == 0, 0.0, xf * scale)
    else:
        xf = x.nan_to_num(0.0, 0.0, 0.0)
        xs = (xf * scale).nan_to_num(0.0, math.inf, -math.inf)
    # The tolerance absorbs float32 rounding of scale * amax (a current scale M / amax can give
    # amax * scale = M + 1 ulp); such an element rounds to M in FP8 and loses nothing to clipping.
    overflow = xs.abs() > fmt_max * OVERFLOW_RTOL
    clipped = torch.minimum(torch.maximum(xs, -fmt_max), fmt_max)
    # q == 0 must dequantise to 0 even for a zero scale: 0 / 0 is the only NaN here.
    if graph:
        q = round_to_fp8_grid(clipped, fconst)
        d = torch.where(q == 0, 0.0, q / scale)
    else:
        q = clipped.to(fp8_dtype).to(torch.float32)
        d = (q / scale).nan_to_num(0.0, math.inf, -math.inf)
    xn = xf * p
    dn = d * p
    en = xn - dn
    if graph:  # counts, exact in any order (see above for the two spellings)
        counts = [t.sum(dim=1, dtype=acc) for t in (finite, xf != 0, d != 0, overflow)]
    else:
        counts = [t.count_nonzero(dim=1).to(acc) for t in (finite, xf, d, overflow)]
    sums = [t.sum(dim=1, dtype=acc) for t in (xn * xn, dn * dn, xn * dn, en * en)]
    return torch.stack(counts + sums, dim=1)


def _tensor_partial_body(
    main: torch.Tensor,
    tail: torch.Tensor | None,
    scale: torch.Tensor,
    use_current: torch.Tensor,
    fconst: torch.Tensor,
    fp8_dtype: torch.dtype | None,
) -> torch.Tensor:
    """Partial without ``numel`` (``PARTIAL_SIZE - 1`` float64 values) of rows ``main`` plus rows ``tail``.

    ``use_current`` (bool 0-d) selects current scaling over ``scale``; ``fp8_dtype`` None = compiled
    flavour (emulated rounding, float32 row sums).
    """
    parts = [main] if tail is None else [main, tail]
    absvals = [_finite_abs(t, fp8_dtype is None) for t in parts]
    amax_v = torch.cat([a.amax(dim=1) for a in absvals]).amax()
    amin_v = torch.cat([torch.where(a > 0, a, math.inf).amin(dim=1) for a in absvals]).amin()
    s = torch.where(use_current, scale_from_amax(amax_v, fconst[_F_MAX], fconst[_F_MARGIN]), scale)
    p = _pow2_normaliser(amax_v)
    acc = torch.float32 if fp8_dtype is None else torch.float64
    rows = torch.cat([_row_sums(t, s, p, fconst, fp8_dtype, acc) for t in parts])
    sums = rows.sum(dim=0, dtype=torch.float64)
    inv_p2 = p.to(torch.float64).reciprocal().square()
    sums = torch.cat([sums[:4], sums[4:] * inv_p2])
    maxes = torch.stack([amax_v, -amin_v, s.amax(), -s.amin()]).to(torch.float64)
    return torch.cat([sums, maxes])


def _merge_two(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Merge two ``[PARTIAL_SIZE]`` partials (sums add, maxima take the max)."""
    return torch.cat([a[:NUM_SUM] + b[:NUM_SUM], torch.maximum(a[NUM_SUM:], b[NUM_SUM:])])


def _compiled_partial(
    main: torch.Tensor,
    tail: torch.Tensor | None,
    into: torch.Tensor,
    scale: torch.Tensor,
    use_current: torch.Tensor,
    fconst: torch.Tensor,
) -> torch.Tensor:
    """What the compiled kernel runs: the partial of rows ``main`` (+ ``tail``) merged into ``into``.

    The element count and the merge are part of the graph, so one call returns the accumulator's
    new value (no eager glue ops around the kernel). The count includes padding of ``tail``; the
    caller removes it.
    """
    numel = main.numel() if tail is None else main.numel() + tail.numel()
    body = _tensor_partial_body(main, tail, scale, use_current, fconst, None)
    return _merge_two(into, torch.cat([body.new_full((1,), numel), body]))


# Inductor stores a pointwise result used by several reductions once it exceeds an op-count or
# read-count threshold; here that would write full-size float32 temporaries. Raising the thresholds
# keeps everything in registers of one loop per pass (CSE shares the work between the reductions).
# On an H200 (torch 2.11, bench/gpu_kernel_probe.py) they make the kernel 3.7x faster on 4096x4096
# bf16 (0.24 vs 0.91 ms) and 6x on 16384x16384 (2.1 vs 12.8 ms) than inductor's defaults.
_INDUCTOR_OPTIONS: dict[str, Any] = {
    "realize_cpu_opcount_threshold": 10_000,
    "realize_opcount_threshold": 10_000,
    "realize_reads_threshold": 10_000,
    "realize_cpu_acc_reads_threshold": 10_000,
    "realize_acc_reads_threshold": 10_000,
}


def _inductor_options() -> dict[str, Any]:
    """:data:`_INDUCTOR_OPTIONS` that this torch's inductor knows: torch 2.11 has no
    ``realize_cpu_opcount_threshold`` and refuses the whole compile over one unknown key."""
    from torch._inductor import config

    return {k: v for k, v in _INDUCTOR_OPTIONS.items() if hasattr(config, k.split(".")[0])}
