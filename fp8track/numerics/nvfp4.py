"""NVFP4 as Transformer Engine defines it: E2M1 values, two-level scales, 2-D weight tiles,
stochastic rounding, the 16x16 random Hadamard transform (pure functions on tensors).

Sources (TransformerEngine's main branch):

* recipe: ``transformer_engine/common/recipe/__init__.py`` ``NVFP4BlockScaling`` (TE >= 2.8):
  ``fp4_quant_fwd_inp`` = RHT (column-wise only), no SR, 1-D; ``fp4_quant_fwd_weight`` = no RHT,
  no SR, 16x16 2-D unless ``disable_2d_quantization``; ``fp4_quant_bwd_grad`` = RHT, SR, 1-D.
  Switches ``NVTE_NVFP4_DISABLE_RHT``, ``NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING``,
  ``NVTE_NVFP4_DISABLE_2D_QUANTIZATION``. "RHT is currently only applied to column-wise usage so
  that it can be used for wgrad GEMM."
* quantiser: ``transformer_engine/pytorch/custom_recipes/quantization_ref_nvfp4.py``
  (``NVFP4QuantizerRef._quantize_blockwise_reference``, ``cast_to_fp4x2``, ``_build_hadamard_matrix``,
  ``get_wgrad_sign_vector``, ``qgemm``), the Python reference of the CUDA kernels in
  ``transformer_engine/common/cast/nvfp4/``.
* statistics: ``transformer_engine/debug/features/utils/stats_computation.py``
  (``count_nonzero_nvfp4``: underflow counts zero E2M1 codes; ``mse`` from the dequantised tensor).
* torchao's prototype ``torchao/prototype/mx_formats/nvfp4_tensor.py`` (``nvfp4_quantize``) follows
  the same two-level scheme; the tests check this module against it.

The quantiser, per tensor ``x`` (float32; non-finite elements are set to 0 here, counted apart by
the statistics):

=========================  =====================================================================
global amax ``A``          max |x| over the finite elements
global encode ``S_enc``    ``448 * 6 / A`` (float32, at most float32 max; 1 when it would be 0)
block decode ``s_b``       E4M3(round-to-nearest-even)( clamp(block amax * (S_enc * (1/6)), 448) )
block encode ``e_b``       ``min(1 / (s_b * (1 / S_enc)), float32 max)``
code ``q``                 E2M1(clamp(x * e_b, -6, 6)): round to nearest even, or stochastic
dequantised ``d``          ``q * s_b * (A / (6 * 448))`` (TE's GEMM: the alpha ``A_a A_b / (6*448)^2``)
=========================  =====================================================================

Blocks: 16 consecutive elements along the last dimension (1-D) or 16x16 tiles (2-D, weights);
a partial block is padded with zeros (as TE's reference pads).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

E2M1_MAX = 6.0
E4M3_MAX = 448.0
NVFP4_BLOCK = 16
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The non-negative E2M1 values (codes 0-7; codes 8-15 are their negatives)."""
_F32_MAX = torch.finfo(torch.float32).max

# TE's hard-coded random signs of the wgrad Hadamard transform
# (quantization_ref_nvfp4.py ``get_wgrad_sign_vector``).
RHT_SIGNS = (1.0, 1.0, 1.0, -1.0, 1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, 1.0, -1.0, 1.0, -1.0, -1.0)


@dataclass(frozen=True)
class NVFP4Options:
    """Which parts of TE's NVFP4 recipe apply to one quantisation.

    Attributes:
        tile_2d: 16x16 blocks (TE's weights) instead of 1x16.
        stochastic: stochastic rounding of the E2M1 cast (TE's gradients).
        rht: random Hadamard transform along the last dimension before quantising (TE's
            column-wise copies of activations and gradients, the wgrad operands).
    """

    tile_2d: bool = False
    stochastic: bool = False
    rht: bool = False


@dataclass(frozen=True)
class NVFP4Recipe:
    """TE's ``NVFP4BlockScaling`` parts that are on (each has a ``disable_*`` switch in TE).

    :meth:`options` gives the :class:`NVFP4Options` of one operand, as TE's recipe sets its
    ``QParams``: activation ``fp4_quant_fwd_inp`` (RHT on the column-wise copy only), weight
    ``fp4_quant_fwd_weight`` (16x16 tiles; never RHT or SR), gradient ``fp4_quant_bwd_grad``
    (SR in both orientations, RHT on the column-wise copy).
    """

    rht: bool = True
    stochastic_rounding: bool = True
    tile_2d: bool = True

    def options(self, tensor: str, columnwise: bool = False) -> NVFP4Options:
        if tensor == "weight":
            return NVFP4Options(tile_2d=self.tile_2d)
        return NVFP4Options(
            stochastic=self.stochastic_rounding and tensor == "gradient", rht=self.rht and columnwise
        )


@dataclass(frozen=True)
class NVFP4Quantized:
    """One NVFP4 quantisation of a 2-D tensor (all float32 on the input's device).

    Attributes:
        codes: E2M1 values ``q`` (in [-6, 6]), shape of the input.
        decode_scales: E4M3 block decode scales ``s_b`` as float32: ``[rows, blocks per row]``
            (1-D) or ``[row tiles, column tiles]`` (2-D).
        encode_scales: ``e_b`` per block, same shape as ``decode_scales``.
        global_amax: ``A`` (0-d).
        dequantized: ``d``, shape of the input.
        clipped: count of elements with ``|x * e_b| > 6`` (clamped before the cast; 0-d int64).
    """

    codes: torch.Tensor
    decode_scales: torch.Tensor
    encode_scales: torch.Tensor
    global_amax: torch.Tensor
    dequantized: torch.Tensor
    clipped: torch.Tensor


def round_e2m1(
    v: torch.Tensor, generator: torch.Generator | None = None, stochastic: bool = False
) -> torch.Tensor:
    """Round values already clamped to [-6, 6] onto the E2M1 grid.

    Round to nearest, ties to even (TE's ``cast_to_fp4x2`` thresholds: 0.25 -> 0, 0.75 -> 1,
    1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4); or stochastically: up to the next grid point
    with probability (|v| - lower) / (upper - lower), with ``generator``'s uniform draws.
    """
    a = v.abs()
    step = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    if stochastic:
        lower = torch.floor(a / step) * step
        frac = (a - lower) / step
        u = torch.rand(a.shape, generator=generator, device=a.device, dtype=torch.float32)
        r = torch.where(u < frac, lower + step, lower)
    else:
        r = torch.round(a / step) * step  # torch.round is round-half-to-even
    return torch.copysign(r.clamp(max=E2M1_MAX), v)


def global_encode_scale(global_amax: torch.Tensor) -> torch.Tensor:
    """``S_enc = 448 * 6 / A`` in float32, capped at float32 max, 1 where it is 0 (A infinite)."""
    a = global_amax.to(torch.float32)
    s = torch.clamp(torch.tensor(E4M3_MAX * E2M1_MAX, dtype=torch.float32, device=a.device) / a, max=_F32_MAX)
    return torch.where(s == 0, torch.ones_like(s), s)


def _finite(x: torch.Tensor) -> torch.Tensor:
    x = x.to(torch.float32)
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _tiles(x: torch.Tensor, tile_rows: int) -> tuple[torch.Tensor, int, int]:
    """``x`` [r, c] padded to whole blocks, as ``[row blocks, col blocks, tile_rows * 16]``."""
    r, c = x.shape
    pr, pc = (-r) % tile_rows, (-c) % NVFP4_BLOCK
    padded = torch.nn.functional.pad(x, (0, pc, 0, pr)) if (pr or pc) else x
    R, C = padded.shape
    t = padded.reshape(R // tile_rows, tile_rows, C // NVFP4_BLOCK, NVFP4_BLOCK).permute(0, 2, 1, 3)
    return t.reshape(R // tile_rows, C // NVFP4_BLOCK, tile_rows * NVFP4_BLOCK), R, C


def _untile(t: torch.Tensor, tile_rows: int, R: int, C: int, r: int, c: int) -> torch.Tensor:
    x = t.reshape(R // tile_rows, C // NVFP4_BLOCK, tile_rows, NVFP4_BLOCK).permute(0, 2, 1, 3).reshape(R, C)
    return x[:r, :c]


def nvfp4_quantize(
    x: torch.Tensor,
    options: NVFP4Options = NVFP4Options(),
    generator: torch.Generator | None = None,
) -> NVFP4Quantized:
    """Quantise ``x`` (any shape, seen as 2-D ``[-1, last dim]``) as TE's NVFP4 quantiser does.

    ``options.rht`` transforms ``x`` first (:func:`random_hadamard_transform`, when the last
    dimension is a multiple of 16; TE requires it); the result then describes the transformed
    tensor, which is what the GEMM multiplies. ``generator`` drives stochastic rounding (pass a
    seeded one for reproducible results; ``None`` uses torch's global generator).
    """
    x2 = _finite(x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x.reshape(1, -1))
    if options.rht:
        x2 = random_hadamard_transform(x2)
    r, c = x2.shape
    tile_rows = NVFP4_BLOCK if options.tile_2d else 1
    t, R, C = _tiles(x2, tile_rows)
    amax = x2.abs().amax() if x2.numel() else torch.zeros((), device=x2.device)
    s_enc = global_encode_scale(amax)
    s_dec_global = 1.0 / s_enc
    block_amax = t.abs().amax(dim=-1, keepdim=True)
    # TE folds 1/6 into the global multiplier and keeps the final reciprocal exact.
    dec = torch.clamp(block_amax * (s_enc * (1.0 / E2M1_MAX)), max=_F32_MAX).clamp(max=E4M3_MAX)
    dec = dec.to(torch.float8_e4m3fn).to(torch.float32)
    enc = torch.clamp(1.0 / (dec * s_dec_global), max=_F32_MAX)
    scaled = t * enc
    clipped = (scaled.abs() > E2M1_MAX).sum()
    q = round_e2m1(scaled.clamp(-E2M1_MAX, E2M1_MAX), generator, options.stochastic)
    deq = q * dec * (amax / (E2M1_MAX * E4M3_MAX))
    return NVFP4Quantized(
        codes=_untile(q, tile_rows, R, C, r, c),
        decode_scales=dec.squeeze(-1),
        encode_scales=enc.squeeze(-1),
        global_amax=amax,
        dequantized=_untile(deq, tile_rows, R, C, r, c),
        clipped=clipped,
    )


def hadamard_matrix(size: int = NVFP4_BLOCK, signs: bool = True) -> torch.Tensor:
    """The orthonormal transform TE applies: ``diag(RHT_SIGNS) @ H / sqrt(size)`` (Sylvester ``H``).

    TE (``_build_hadamard_matrix``, ``_apply_rht``) multiplies rows of 16 by this matrix on the right.
    """
    if size <= 0 or size & (size - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {size}")
    h = torch.ones(1, 1)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    if signs:
        if size != NVFP4_BLOCK:
            raise ValueError(f"TE's random signs are defined for size {NVFP4_BLOCK}, got {size}")
        h = torch.diag(torch.tensor(RHT_SIGNS)) @ h
    return h / size**0.5


def random_hadamard_transform(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Apply TE's 16-point random Hadamard transform to consecutive groups of 16 along the last
    dimension (float32). A last dimension that is not a multiple of 16 is returned unchanged
    (TE refuses such NVFP4 shapes). ``inverse=True`` undoes it (the matrix is orthonormal)."""
    n = x.shape[-1]
    if n % NVFP4_BLOCK:
        return x.to(torch.float32)
    m = hadamard_matrix().to(x.device)
    m = m.t() if inverse else m
    return (x.to(torch.float32).reshape(-1, NVFP4_BLOCK) @ m).reshape(x.shape)


def columnwise_operand(x: torch.Tensor, rht: bool) -> torch.Tensor:
    """The column-wise copy TE quantises for the wgrad GEMM: ``x`` seen 2-D, transposed (blocks
    run along the token dimension), Hadamard-transformed when ``rht``."""
    x2 = x.reshape(-1, x.shape[-1]).to(torch.float32).t()
    return random_hadamard_transform(x2) if rht else x2


BLOCK_RANGE_STAT = "max_blockwise_dynamic_range"
"""The name of :func:`blockwise_dynamic_range`'s statistic in block rows (TE's ``LogTensorStats``
name), used by the capture, the ranking and the report alike."""


def blockwise_dynamic_range(
    x: torch.Tensor,
    block_size: int = 32,
    dims: int = 1,
    max_over_orientations: bool = False,
    columnwise: bool = False,
) -> torch.Tensor:
    """TE's ``LogTensorStats`` statistic ``max_blockwise_dynamic_range`` as a 0-d float32 tensor on
    ``x``'s device (no host sync), in log2 units (binades).

    TE's ``compute_max_blockwise_dynamic_range``
    (``transformer_engine/debug/features/utils/stats_computation.py``): ``x`` seen 2-D
    ``[-1, last dim]``, cut into blocks of ``block_size`` consecutive elements of a row
    (``dims=1``) or ``block_size`` x ``block_size`` tiles (``dims=2``); per block
    ``log2(amax) - log2(smallest nonzero |x|)``, 0 for an all-zero block; the largest over blocks.
    ``max_over_orientations`` also cuts the transposed tensor and takes the larger (TE sets it for
    activations and weights, whose GEMMs read both orientations); ``columnwise`` cuts only the
    transposed tensor (blocks along the first dimension). Differences from TE, which asserts whole
    blocks and sees only finite values: a partial block is padded with zeros (which change neither
    its amax nor its nonzero minimum) and non-finite elements count as 0.

    Cost: the extremes are exact elements, so they are taken in ``x``'s own dtype (half the bytes
    of float32 for BF16) over strided views (no transposed copy); only the per-block results are
    widened to float32.
    """
    orientation = "both" if max_over_orientations else "column" if columnwise else "row"
    return blockwise_dynamic_ranges(x, [(block_size, dims, orientation)])[0]


BLOCK_ORIENTATIONS = ("row", "column", "both")


def blockwise_dynamic_ranges(
    x: torch.Tensor, specs: Sequence[tuple[int, int, str]]
) -> list[torch.Tensor]:
    """:func:`blockwise_dynamic_range` of ``x`` for several ``(block_size, dims, orientation)``
    (orientation ``"row"``, ``"column"`` or ``"both"``, :data:`BLOCK_ORIENTATIONS`) at once: ``|x|``
    is prepared once and each block shape reduced once, whichever specs share it."""
    for size, dims, orientation in specs:
        if dims not in (1, 2):
            raise ValueError(f"dims must be 1 or 2, got {dims}")
        if size < 1:
            raise ValueError(f"block_size must be >= 1, got {size}")
        if orientation not in BLOCK_ORIENTATIONS:
            raise ValueError(f"orientation must be one of {BLOCK_ORIENTATIONS}, got {orientation!r}")
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x.reshape(1, -1)
    if x2.numel() == 0:
        return [torch.zeros((), dtype=torch.float32, device=x.device) for _ in specs]
    a = x2.abs() if x2.is_floating_point() and x2.element_size() >= 2 else x2.float().abs()
    a = a.contiguous().nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    nonzero_min = a.masked_fill(a == 0, float("inf"))
    done: dict[tuple[int, int], torch.Tensor] = {}

    def blocks(br: int, bc: int) -> torch.Tensor:
        if (br, bc) not in done:
            done[(br, bc)] = _blocks_range(a, nonzero_min, br, bc)
        return done[(br, bc)]

    out = []
    for size, dims, orientation in specs:
        if dims == 2:  # a tile's transpose is a tile of the transposed tensor: one value either way
            out.append(blocks(size, size))
        elif orientation == "both":
            out.append(torch.maximum(blocks(1, size), blocks(size, 1)))
        else:
            out.append(blocks(1, size) if orientation == "row" else blocks(size, 1))
    return out


def _blocks_range(a: torch.Tensor, nonzero_min: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """Largest ``log2(amax / nonzero amin)`` over the ``br`` x ``bc`` blocks of ``|x|`` (``a``; its
    zeros set to +inf in ``nonzero_min``), zero-padded to whole blocks; all-zero blocks give 0."""
    r, c = a.shape
    pr, pc = (-r) % br, (-c) % bc
    if pr or pc:
        a = torch.nn.functional.pad(a, (0, pc, 0, pr))
        nonzero_min = torch.nn.functional.pad(nonzero_min, (0, pc, 0, pr), value=float("inf"))
    shape = ((r + pr) // br, br, (c + pc) // bc, bc)
    hi = a.reshape(shape).amax(dim=(1, 3)).float()
    lo = nonzero_min.reshape(shape).amin(dim=(1, 3)).float()
    return torch.where(hi > 0, torch.log2(hi) - torch.log2(lo), torch.zeros_like(hi)).amax()


def max_blockwise_dynamic_range(
    x: torch.Tensor, block_size: int = 32, dims: int = 1, max_over_orientations: bool = False
) -> float:
    """:func:`blockwise_dynamic_range` as a Python float (waits for the device)."""
    return float(blockwise_dynamic_range(x, block_size, dims, max_over_orientations))


_SEEDS = itertools.count(0x5EED)


def new_generator(device: torch.device | str) -> torch.Generator:
    """A private generator for stochastic rounding, seeded from a process-wide counter: reproducible
    for the same order of creation, and never touching torch's global random stream (monitoring
    and a BF16 control then see the same dropout and data order)."""
    return torch.Generator(device=device).manual_seed(next(_SEEDS))
