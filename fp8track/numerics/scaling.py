"""Scale maths: current (per-tensor), delayed (amax history), and block scales.

Convention (as in Transformer Engine and torchao): the *scale* multiplies the high-precision
tensor on the way into FP8, ``q = saturating_cast(x * scale)``, and dequantisation divides,
``d = q / scale``. GEMM kernels are given ``scale_inv = 1 / scale``.

All functions are pure tensor maths that stay on the tensor's device (no host synchronisation),
work under ``torch.no_grad`` and compute in float32.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fp8track.errors import ConfigError, check_int, invalid_choice, restore_state, save_state
from fp8track.numerics.formats import FP8Format, fp8_to_float32, get_format

FLOAT32_MAX = torch.finfo(torch.float32).max
AMAX_COMPUTE_ALGOS = ("max", "most_recent")


def amax(x: torch.Tensor) -> torch.Tensor:
    """``max(|x|)`` over the non-NaN elements, as a float32 0-d tensor (0 for an empty or all-NaN
    tensor; inf propagates).

    NaN elements are skipped as Transformer Engine's amax kernels skip them: its cast and amax
    kernels reduce with ``fmaxf`` / ``__hmax`` (``common/recipe/current_scaling.cu``, the fused
    cast kernels), which return the other operand when one is NaN. A NaN amax would instead keep
    the previous scale and, under delayed scaling, sit in the history for ``amax_history_len``
    steps, freezing the scale that long.
    """
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    # nan_to_num in place on abs's copy: no second temporary (torch.where is unvectorised on CPU)
    return x.detach().abs().nan_to_num_(0.0, math.inf).amax().to(torch.float32)


def scale_from_amax(
    amax_value: torch.Tensor,
    fmt_max: torch.Tensor | float,
    margin_factor: torch.Tensor | float = 1.0,
    previous: torch.Tensor | float = 1.0,
) -> torch.Tensor:
    """THE current-scaling rule: ``fmt_max / amax * margin_factor`` (``margin_factor = 2**-margin``).

    Guards follow Transformer Engine's ``_default_sf_compute``: where amax is 0, inf or NaN the
    previous scale is kept (default 1.0), and an infinite result (a tiny amax) is clamped to the
    float32 maximum so the scale stays finite. The format constants may be device tensors, so one
    compiled graph serves every format and margin (:mod:`fp8track.numerics.stats`); computed in
    float32.
    """
    amax_value = amax_value.to(torch.float32)
    # TE (nvcc, IEEE division) and torchao compute the correctly rounded float32 quotient. The
    # division runs in float64 and is then rounded to float32: float64 carries more than 2*24+2 bits,
    # so that double rounding gives the same float32, and it does so on every backend (Triton's
    # float32 division on CUDA is approximate, off by an ulp; ``python_float / tensor`` runs as
    # reciprocal-then-multiply). Multiplying by a power of two is exact: ``* 2**-margin``.
    numerator = fmt_max if isinstance(fmt_max, torch.Tensor) else torch.full_like(amax_value, fmt_max)
    if amax_value.device.type == "mps":  # MPS has no float64: divide in float32 there
        quotient = torch.div(numerator, amax_value)
    else:
        quotient = torch.div(numerator.to(torch.float64), amax_value.to(torch.float64)).to(torch.float32)
    scale = quotient * margin_factor
    usable = (amax_value > 0) & torch.isfinite(amax_value)
    scale = torch.where(usable, scale, previous)
    return torch.where(torch.isinf(scale), FLOAT32_MAX, scale)


def current_scale(
    amax_value: torch.Tensor,
    fmt: str | FP8Format,
    margin: int = 0,
    previous: torch.Tensor | float = 1.0,
) -> torch.Tensor:
    """Current-scaling factor ``fmt.max / amax / 2**margin`` (float32, same shape as ``amax_value``),
    by :func:`scale_from_amax` (where amax is unusable: ``previous``)."""
    fmt = get_format(fmt)
    amax_value = amax_value.to(torch.float32)
    prev = torch.as_tensor(previous, dtype=torch.float32, device=amax_value.device).expand_as(amax_value)
    return scale_from_amax(amax_value, fmt.max, 2.0**-margin, prev)


def drift_log2(scale: float, current: float) -> float:
    """Scale drift ``log2(scale / current)`` in binades (docs/statistics.md).

    ``+inf`` for an infinite ``scale``, ``-inf`` for a zero one; NaN when ``scale`` is NaN or
    negative or ``current`` is not a positive finite number (nothing to compare with).

    Example:
        >>> drift_log2(4.0, 1.0), drift_log2(1.0, 8.0), drift_log2(0.0, 1.0)
        (2.0, -3.0, -inf)
    """
    if not (current > 0 and math.isfinite(current)) or not scale >= 0:
        return math.nan
    if scale == 0:
        return -math.inf
    if math.isinf(scale):
        return math.inf
    return math.log2(scale) - math.log2(current)


def saturating_cast(x_scaled: torch.Tensor, fmt: str | FP8Format) -> torch.Tensor:
    """Cast an already scaled float tensor to FP8, clamping to ``±fmt.max`` first.

    The explicit clamp makes the result independent of the torch version and device: torch < 2.13
    and CUDA may turn e4m3 overflow into NaN, torch 2.13 on CPU saturates (docs/statistics.md).
    NaN stays NaN; ±inf becomes ±max.
    """
    fmt = get_format(fmt)
    return x_scaled.clamp(-fmt.max, fmt.max).to(fmt.dtype)


def quantize(x: torch.Tensor, fmt: str | FP8Format, scale: torch.Tensor | float) -> torch.Tensor:
    """``saturating_cast(x * scale)``; ``scale`` may be a scalar or broadcast against ``x``."""
    return saturating_cast(x.to(torch.float32) * scale, fmt)


def dequantize(
    q: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``q / scale`` in ``dtype`` (float32 by default)."""
    return (fp8_to_float32(q) / scale).to(dtype)


def delayed_scaling_update(
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    fmt: str | FP8Format,
    algo: str = "max",
    margin: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One Transformer Engine delayed-scaling update, for one tensor or many side by side.

    ``amax_history`` is ``[L, ...]`` with this step's amax already in slot 0; ``scale`` is ``[...]``.
    The amax is the history's max over L (``"max"``) or slot 0 (``"most_recent"``); the new scale
    is :func:`current_scale` of it (keeping the old scale where the amax is unusable); then the
    history rolls by -1 and slot 0 is zeroed (TE's ``_update_amax_history``).

    Returns:
        ``(new_history, new_scale)``; the inputs are not modified.
    """
    amax_value = amax_history.amax(dim=0) if algo == "max" else amax_history[0]
    new_scale = current_scale(amax_value, fmt, margin, scale)
    history = torch.roll(amax_history, -1, 0) if amax_history.shape[0] > 1 else amax_history.clone()
    history[0] = 0.0
    return history, new_scale


class DelayedScaler:
    """Delayed scaling of one tensor, as Transformer Engine's ``DelayedScaling`` recipe does it.

    State: an amax history of ``history_len`` float32 slots and the current scale (starts at 1.0,
    as in TE, so the very first step quantises with scale 1). One step:

    1. quantise with the *current* scale (:meth:`quantize` returns it as ``scale_used``);
    2. write this tensor's amax into history slot 0 (:meth:`observe`);
    3. :meth:`update`: amax = max over the history (``"max"``) or slot 0 (``"most_recent"``);
       scale = :func:`current_scale` (amax, margin, previous scale); then the history rolls by -1
       and slot 0 is zeroed, exactly as TE's ``_update_amax_history``.

    Tensors live on the device of the first tensor observed; nothing synchronises with the host.
    ``shape`` scales many tensors side by side (one history and scale per element: the experts of
    a grouped GEMM, each with its own quantizer as in TE's ``GroupedLinear``).
    """

    def __init__(
        self,
        fmt: str | FP8Format,
        history_len: int = 1024,
        algo: str = "max",
        margin: int = 0,
        shape: tuple[int, ...] = (),
    ) -> None:
        self.fmt = get_format(fmt)
        check_int("amax_history_len", history_len, 1)
        if algo not in AMAX_COMPUTE_ALGOS:
            raise invalid_choice("amax_compute_algo", algo, AMAX_COMPUTE_ALGOS)
        check_int("margin", margin, 0)
        self.history_len = history_len
        self.algo = algo
        self.margin = margin
        self.shape = tuple(shape)
        self.amax_history = torch.zeros((history_len, *self.shape), dtype=torch.float32)
        self.scale = torch.ones(self.shape, dtype=torch.float32)

    def _to(self, device: torch.device) -> None:
        if self.scale.device != device:
            self.amax_history = self.amax_history.to(device)
            self.scale = self.scale.to(device)

    def observe(self, amax_value: torch.Tensor) -> None:
        """Record ``amax_value`` in slot 0 (the max, if several micro-batches write before an update).

        A NaN amax leaves the slot as it was, as TE's ``fmaxf`` does (see :func:`amax`)."""
        self._to(amax_value.device)
        self.amax_history[0] = torch.fmax(self.amax_history[0], amax_value.to(torch.float32))

    def update(self) -> torch.Tensor:
        """Compute the next scale from the history, roll the history; returns the new scale."""
        self.amax_history, self.scale = delayed_scaling_update(
            self.amax_history, self.scale, self.fmt, self.algo, self.margin
        )
        return self.scale

    @torch.no_grad()
    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One delayed-scaling step on ``x``: returns ``(fp8 tensor, scale_used)`` and updates state."""
        self._to(x.device)
        scale_used = self.scale.clone()
        q = quantize(x, self.fmt, scale_used)
        self.observe(amax(x))
        self.update()
        return q, scale_used

    def state_dict(self) -> dict[str, Any]:
        """Plain-data state (:func:`fp8track.errors.save_state`; CPU tensors).

        Enough to resume bit for bit."""
        return save_state(
            amax_history=self.amax_history.detach().cpu().clone(),
            scale=self.scale.detach().cpu().clone(),
            history_len=self.history_len,
            algo=self.algo,
            margin=self.margin,
            fmt=self.fmt.name,
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`; tolerant of missing keys (they keep their value)."""
        restore_state(self, state, {"amax_history": self._load_history, "scale": self._load_scale})

    def _load_history(self, value: Any) -> None:
        hist = torch.as_tensor(value, dtype=torch.float32)
        if hist.numel() != self.amax_history.numel():
            raise ConfigError(
                f"checkpointed amax history has shape {tuple(hist.shape)}, this scaler expects "
                f"{tuple(self.amax_history.shape)} (history length {self.history_len})"
            )
        hist = hist.reshape(self.amax_history.shape)
        self.amax_history = hist.to(self.amax_history.device).clone()

    def _load_scale(self, value: Any) -> None:
        self.scale = torch.as_tensor(value, dtype=torch.float32).to(self.scale.device).clone()


# --- block scales --------------------------------------------------------------------------------


def blockify_rows(x: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    """View ``x`` as 1 x ``block`` blocks along its last dimension.

    Returns ``(blocks, pad)``: ``blocks`` has shape ``[num_blocks, block]`` and ``pad`` is the number
    of zeros appended to complete the last block of each row (zeros change no statistic except
    the element count, which callers correct with ``pad``).
    """
    rows = x.reshape(-1, x.shape[-1]) if x.dim() > 0 else x.reshape(1, 1)
    cols = rows.shape[1]
    pad_cols = (-cols) % block
    if pad_cols:
        rows = torch.nn.functional.pad(rows, (0, pad_cols))
    return rows.reshape(-1, block), pad_cols * rows.shape[0]


def unblockify_rows(blocks: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Inverse of :func:`blockify_rows` for a tensor of the original ``shape``."""
    cols = shape[-1] if len(shape) else 1
    rows = blocks.reshape(-1, cols + ((-cols) % blocks.shape[1]))
    return rows[:, :cols].reshape(shape)


def blockify_tiles(x: torch.Tensor, tile: int) -> tuple[torch.Tensor, int]:
    """View a 2-D ``x`` as ``tile x tile`` tiles: ``([num_tiles, tile*tile], pad)``."""
    if x.dim() != 2:
        raise ValueError(f"2-D tiles need a 2-D tensor, got shape {tuple(x.shape)}")
    r, c = x.shape
    pr, pc = (-r) % tile, (-c) % tile
    padded = torch.nn.functional.pad(x, (0, pc, 0, pr)) if (pr or pc) else x
    R, C = padded.shape
    tiles = padded.reshape(R // tile, tile, C // tile, tile).permute(0, 2, 1, 3).reshape(-1, tile * tile)
    return tiles, R * C - r * c


def unblockify_tiles(tiles: torch.Tensor, shape: torch.Size, tile: int) -> torch.Tensor:
    """Inverse of :func:`blockify_tiles`."""
    r, c = shape
    R, C = r + (-r) % tile, c + (-c) % tile
    padded = tiles.reshape(R // tile, C // tile, tile, tile).permute(0, 2, 1, 3).reshape(R, C)
    return padded[:r, :c]


# The block-scaling vocabulary, one table: layout name -> (block edge, 2-D tiles, scale rule).
# Transformer Engine (transformer_engine/common/recipe/__init__.py): MXFP8BlockScaling uses 1x32
# blocks with E8M0 scales for every tensor; Float8BlockScaling uses 1x128 blocks for activations
# and gradients (x_block_scaling_dim=1, grad_block_scaling_dim=1) and 128x128 tiles for weights
# (w_block_scaling_dim=2), with power-of-two scales.
BLOCK_LAYOUTS: dict[str, tuple[int, bool, str]] = {
    "mxfp8": (32, False, "e8m0"),
    "block128": (128, False, "pow2"),
    "block128x128": (128, True, "pow2"),
}
BLOCK_SCALINGS = ("mxfp8", "block")
"""The block-scaled recipe families (``Recipe.scaling`` values)."""


def block_layout(scaling: str, tensor: str) -> str:
    """The :data:`BLOCK_LAYOUTS` name block recipe ``scaling`` uses for ``tensor`` (any operand
    orientation: TE quantises each copy along the GEMM's reduction dimension with the same layout)."""
    if scaling not in BLOCK_SCALINGS:
        raise invalid_choice("block scaling", scaling, BLOCK_SCALINGS)
    if scaling == "mxfp8":
        return "mxfp8"
    return "block128x128" if tensor == "weight" else "block128"


def _layout(layout: str) -> tuple[int, bool, str]:
    if layout not in BLOCK_LAYOUTS:
        raise invalid_choice("block layout", layout, tuple(BLOCK_LAYOUTS))
    return BLOCK_LAYOUTS[layout]


def blockify(x: torch.Tensor, layout: str) -> tuple[torch.Tensor, int]:
    """``x`` as ``[num_blocks, block elements]`` for ``layout`` plus the padding count (tiles see
    ``x`` as 2-D ``[-1, last dim]``)."""
    size, tiles, _ = _layout(layout)
    if tiles:
        return blockify_tiles(x if x.dim() == 2 else x.reshape(-1, x.shape[-1]), size)
    return blockify_rows(x, size)


def unblockify(blocks: torch.Tensor, shape: torch.Size, layout: str) -> torch.Tensor:
    """Inverse of :func:`blockify` for a tensor of ``shape`` (2-D for tiles)."""
    size, tiles, _ = _layout(layout)
    return unblockify_tiles(blocks, shape, size) if tiles else unblockify_rows(blocks, shape)


def block_scales(
    blocks: torch.Tensor, layout: str, fmt: str | FP8Format, power_2_scales: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block amax, scale)``, each ``[num_blocks, 1]`` float32, of :func:`blockify` output.

    The amax ignores non-finite elements; the scale follows the layout's rule
    (:func:`mx_block_scales` or :func:`pow2_block_scales`). ``power_2_scales=False`` gives the
    128-block layouts plain float32 scales ``fmt.max / amax`` (TE's
    ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1``); MXFP8 (E8M0) scales are always powers of two.
    """
    _, _, rule = _layout(layout)
    finite_abs = torch.where(torch.isfinite(blocks), blocks.abs(), 0.0).to(torch.float32)
    block_amax = finite_abs.amax(dim=1, keepdim=True)
    if rule == "e8m0":
        scale = mx_block_scales(block_amax, fmt)[0]
    elif power_2_scales:
        scale = pow2_block_scales(block_amax, fmt)
    else:
        scale = current_scale(block_amax, fmt)
    return block_amax, scale


def mx_block_scales(block_amax: torch.Tensor, fmt: str | FP8Format) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 scales for blocks with the given amax: ``(scale float32, E8M0 codes uint8)``.

    Transformer Engine's MXFP8 cast computes ``scale_inv = 2**ceil(log2(amax / fmt.max))`` (its
    ``float_to_e8m0`` rounds *up*), so a block's amax never exceeds ``fmt.max`` after scaling;
    the OCP MX spec's ``floor(log2(amax)) - emax`` can instead saturate the largest element.
    An all-zero block gets code 0 (scale_inv 2**-127), as TE's rounding of 0 does.
    """
    fmt = get_format(fmt)
    ratio = block_amax.to(torch.float32) * (1.0 / fmt.max)
    mantissa, exponent = torch.frexp(ratio)  # ratio = mantissa * 2**exponent, mantissa in [0.5, 1)
    # ceil(log2(ratio)) is exponent - 1 when ratio is an exact power of two, else exponent.
    exp_ceil = torch.where(mantissa == 0.5, exponent - 1, exponent)
    exp_ceil = torch.where(ratio > 0, exp_ceil, torch.full_like(exp_ceil, -127)).clamp(-127, 127)
    codes = (exp_ceil + 127).to(torch.uint8)
    scale = torch.exp2(-exp_ceil.to(torch.float32))
    return scale, codes


def pow2_block_scales(block_amax: torch.Tensor, fmt: str | FP8Format) -> torch.Tensor:
    """Float8 block-scaling (128 / 128x128) scales: ``fmt.max / amax`` rounded *down* to a power of two.

    Rounding the scale down keeps ``amax * scale <= fmt.max`` (TE's default power-of-two scales);
    an all-zero or non-finite block gets scale 1. A block so small that ``fmt.max / amax``
    overflows float32 (amax below ~1.3e-36 for E4M3: float32- or bf16-subnormal data) gets
    ``2**127``, as TE's ``compute_scale_from_types`` (``common/recipe/recipe_common.cuh``)
    replaces the infinite scale by the input type's maximum before clearing the mantissa.
    """
    fmt = get_format(fmt)
    a = block_amax.to(torch.float32)
    raw = fmt.max / a
    raw = torch.where(torch.isinf(raw) & (a > 0), FLOAT32_MAX, raw)
    mantissa, exponent = torch.frexp(raw)
    del mantissa
    scale = torch.exp2((exponent - 1).to(torch.float32))  # 2**floor(log2(raw)) for finite raw > 0
    usable = (a > 0) & torch.isfinite(a) & torch.isfinite(raw)
    return torch.where(usable, scale, torch.ones_like(scale))


def block_fake_quantize(x2d: torch.Tensor, layout: str, fmt: FP8Format) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantise then dequantise a 2-D tensor along its last dimension.

    Args:
        x2d: 2-D tensor; blocks run along dim 1 (the GEMM's reduction dimension).
        layout: a :data:`~fp8track.numerics.scaling.BLOCK_LAYOUTS` name: ``mxfp8`` (1x32, E8M0
            scales rounded up as TE), ``block128`` (1x128, power-of-two scales), ``block128x128``
            (128x128 tiles, power-of-two scales).
        fmt: element format.

    Returns:
        ``(dequantised float32 tensor of x2d's shape, scales)``; scales have shape
        ``[rows, blocks per row]`` (``[row tiles, column tiles]`` for tiles).
    """
    x = x2d.to(torch.float32)
    size, tiles, _ = BLOCK_LAYOUTS[layout]
    if x.numel() == 0:  # an expert without tokens
        return x, x.new_ones(0, 0)
    blocks, _ = blockify(x, layout)
    _, scale = block_scales(blocks, layout, fmt)
    deq = unblockify(dequantize(quantize(blocks, fmt, scale), scale), x.shape, layout)
    grid = (-(-x.shape[0] // size), -(-x.shape[1] // size)) if tiles else (x.shape[0], -1)
    return deq, scale.reshape(grid)
