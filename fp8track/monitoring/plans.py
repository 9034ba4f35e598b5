"""How one layer's tensors are judged: its :class:`LayerPlan` and the partial of a tensor under it.

The scale a tensor is judged with comes from the layer's plan: the backend's own scale where it
exposes one (delayed scaling, :func:`plan_for`), else the recipe's rule applied to the tensor
itself (current or block scaling), or current scaling for BF16 layers (shadow mode,
:func:`shadow_plan`: what FP8 would do to them). :func:`tensor_partial` turns one observed tensor
into a statistics partial (:mod:`fp8track.numerics.stats`) as the plan quantises it, or as a
what-if scaling would; :func:`block_range_spec` says how a block row measures TE's
``max_blockwise_dynamic_range``. The hooks that observe the tensors are in
:mod:`fp8track.monitoring.capture`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from fp8track.execution.backends import backend_of
from fp8track.monitoring.sharding import Share
from fp8track.numerics.formats import TENSOR_KINDS, get_format_pair
from fp8track.numerics.nvfp4 import NVFP4_BLOCK, NVFP4Recipe, new_generator
from fp8track.numerics.scaling import BLOCK_LAYOUTS, BLOCK_SCALINGS, amax, block_layout, current_scale
from fp8track.numerics.stats import (
    block_partial_stats,
    empty_partial,
    merge_partials,
    nvfp4_partial_stats,
    partial_stats,
)

# How a tensor is scaled, per recipe family. "per_tensor" covers delayed, current and
# fp8_input_bf16_gemm (one scale per tensor); block recipes carry their own per-block scales.
SCALING_KINDS = ("per_tensor", *BLOCK_SCALINGS, "nvfp4")
WHATIF_VARIANTS = ("current", *BLOCK_SCALINGS, "nvfp4")
COLUMNWISE_SCALINGS = (*BLOCK_SCALINGS, "nvfp4")
"""Scalings whose column-wise copy (the dgrad/wgrad operand TE quantises along the other axis)
differs from the row-wise one: each gets a ``<variant>_columnwise`` row, like TE's ``_columnwise``
statistics (per-tensor scales are the same in both orientations)."""
_STATS_GENERATORS: dict[torch.device, torch.Generator] = {}

ScaleFn = Callable[[], "torch.Tensor | None"]


@dataclass(frozen=True)
class LayerPlan:
    """How one layer's tensors are judged.

    Attributes:
        fqn: qualified module name.
        fp8: True when the layer really runs in FP8; False for BF16 layers (shadow statistics).
        formats: FP8 element format per tensor kind (``"e4m3"``/``"e5m2"``).
        scaling: one of :data:`SCALING_KINDS`.
        scale_fns: per tensor kind, a function returning the backend's scale for the tensor being
            observed (``None`` -> current scaling computed from the tensor itself).
        margin: current-scaling margin.
        power_2_scales: round re-derived scales down to a power of two (TE's
            ``NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES`` for current scaling; 128-block recipes:
            ``None`` means their default, power-of-two, ``False`` TE's float32 block scales).
    """

    fqn: str
    fp8: bool
    formats: dict[str, str]
    scaling: str = "per_tensor"
    scale_fns: dict[str, ScaleFn] = field(default_factory=dict)
    margin: int = 0
    power_2_scales: bool | None = None
    nvfp4: NVFP4Recipe | None = None

    @property
    def variant(self) -> str:
        return "actual" if self.fp8 else "shadow"


def tensor_partial(
    x: torch.Tensor,
    plan: LayerPlan,
    tensor: str,
    scaling: str | None = None,
    share: Share | None = None,
    into: torch.Tensor | None = None,
) -> torch.Tensor:
    """Partial of ``x`` as ``plan`` quantises it (or as ``scaling`` would, for what-if variants),
    merged into the accumulator ``into`` when given (the compiled kernel merges in the same call).

    ``share``: this rank's share of a distributed ``x`` (:func:`fp8track.monitoring.sharding.share_of`).
    """
    scaling = scaling or plan.scaling
    fmt = fp8_format(plan, tensor)
    if share is not None and not share.trivial:
        p = _shared_partial(share, plan, tensor, scaling)
        return p if into is None else merge_partials([into, p])
    if scaling == "per_tensor" or scaling == "current":
        scale_fn = plan.scale_fns.get(tensor) if scaling == "per_tensor" else None
        scale = scale_fn() if scale_fn is not None else None
        if scale is None and plan.power_2_scales:
            scale = pow2_current_scale(x, fmt, plan.margin)
        return partial_stats(x, fmt, scale, plan.margin, into=into)
    if x.dim() < 1 or x.shape[-1] == 0:
        return partial_stats(x, fmt, None, plan.margin, into=into)
    base = scaling.removesuffix("_columnwise")
    columnwise = base != scaling
    if base == "nvfp4":
        options = (plan.nvfp4 or NVFP4Recipe()).options(tensor, columnwise)
        gen = None
        if options.stochastic:  # a private generator: monitoring never moves torch's random stream
            gen = _STATS_GENERATORS.setdefault(x.device, new_generator(x.device))
        p = nvfp4_partial_stats(x, options, columnwise, gen)
    else:
        if columnwise:
            x = x.reshape(-1, x.shape[-1]).t()
        p = block_partial_stats(x, block_layout(base, tensor), fmt, plan.power_2_scales is not False)
    return p if into is None else merge_partials([into, p])


RangeSpec = tuple[int, int, str]
"""``(block_size, dims, orientation)`` of one ``max_blockwise_dynamic_range``: orientation
``"both"`` (TE's ``max_over_orientations``), ``"row"`` or ``"column"``
(:func:`~fp8track.numerics.nvfp4.blockwise_dynamic_ranges`)."""


def block_range_spec(plan: LayerPlan, tensor: str, variant: str, scaling: str | None) -> RangeSpec | None:
    """How the ``(tensor, variant)`` row of ``plan`` measures ``max_blockwise_dynamic_range``, or
    ``None`` for per-tensor rows (the statistic is TE's blockwise one: block recipes only).

    The block is the one the variant quantises with (``scaling``: the what-if scaling, ``None``
    for the plan's own): MXFP8 1x32; 128-block recipes 1x128, weights 128x128; NVFP4 1x16,
    weights 16x16 when the recipe's 2-D weight tiles are on. The orientation follows TE's
    ``LogTensorStats._parse_max_blockwise_dynamic_range_stats`` (``max_over_orientations`` for
    activations and weights, gradients row-wise) on the row-wise row; a ``_columnwise`` row
    measures the column-wise blocks alone (the operand it describes, before NVFP4's RHT: TE's
    statistic reads the high-precision tensor)."""
    s = scaling or plan.scaling
    base = s.removesuffix("_columnwise")
    if base not in COLUMNWISE_SCALINGS:
        return None
    if base == "nvfp4":
        tiles = tensor == "weight" and (plan.nvfp4 or NVFP4Recipe()).tile_2d
        size = NVFP4_BLOCK
    else:
        size, tiles, _ = BLOCK_LAYOUTS[block_layout(base, tensor)]
    if variant.endswith("_columnwise"):
        orientation = "column"
    else:
        orientation = "both" if tensor in ("activation", "weight") else "row"
    return size, 2 if tiles else 1, orientation


def fp8_format(plan: LayerPlan, tensor: str) -> str:
    """The FP8 format FP8 what-ifs of ``plan`` use (E4M3 for an NVFP4 layer's E2M1 operands)."""
    fmt = plan.formats[tensor]
    return "e4m3" if fmt == "e2m1" else fmt


def variant_format(plan: LayerPlan, tensor: str, variant: str) -> str:
    """The element format a ``(tensor, variant)`` row of ``plan`` is finalised with."""
    base = variant.removesuffix("_columnwise")
    if base == "nvfp4" or (base in ("actual", "shadow") and plan.scaling == "nvfp4"):
        return "e2m1"
    return fp8_format(plan, tensor)


def pow2_current_scale(x: torch.Tensor, fmt: str, margin: int = 0, amax_epsilon: float = 0.0) -> torch.Tensor:
    """Current scaling as TE's ``compute_scale_from_amax`` computes it (``common/recipe/recipe_common.cuh``):
    ``M / max(amax, eps) / 2**margin``, with the mantissa bits cleared (rounded down to a power
    of two); 1 where amax is 0 or not finite. On device, no host sync."""
    a = torch.clamp_min(amax(x), amax_epsilon) if amax_epsilon > 0 else amax(x)
    s = current_scale(a, fmt, margin)
    _, exponent = torch.frexp(s)
    return torch.where(torch.isfinite(a) & (a > 0), torch.exp2((exponent - 1).to(torch.float32)), s)


def _shared_partial(share: Share, plan: LayerPlan, tensor: str, scaling: str) -> torch.Tensor:
    """This rank's part of a distributed tensor, judged with the scale of the whole logical tensor."""
    fmt = plan.formats[tensor]
    if scaling == "per_tensor" or scaling == "current":
        scale_fn = plan.scale_fns.get(tensor) if scaling == "per_tensor" else None
        scale = scale_fn() if scale_fn is not None else None
        if scale is None:
            scale = share.scale(fmt, plan.margin)
        return partial_stats(share.part(), fmt, scale, plan.margin)
    # Block recipes: slicing would cut blocks, so the first copy takes its whole local tensor.
    if share.piece:
        return empty_partial(share.local.device)
    return tensor_partial(share.local, plan, tensor, scaling)


def shadow_plan(fqn: str, fmt_pair: str = "hybrid") -> LayerPlan:
    """Plan for a BF16 layer: current scaling in ``fmt_pair`` (what FP8 would do to it)."""
    pair = get_format_pair(fmt_pair)
    formats = {t: pair.for_tensor(t).name for t in TENSOR_KINDS}
    return LayerPlan(fqn=fqn, fp8=False, formats=formats)


class RowlessCapture:
    """The interface the monitor asks of a layer capture (keys, partials, FLOPs, a high-precision
    plan), for a capture that writes no statistics rows: an MoE router's metrics
    (:class:`fp8track.monitoring.router_capture.RouterCapture`), a module's FLOPs
    (:class:`fp8track.monitoring.module_flops.ModuleFlopsCapture`). Subclasses count into ``flops``."""

    def __init__(self, name: str) -> None:
        self.plan: LayerPlan = shadow_plan(name)
        self.recorder = None  # no tensors to dump
        self.flops = 0
        self.active = False

    def keys(self) -> list[tuple[str, str]]:
        return []

    def range_keys(self) -> list[tuple[str, str]]:
        return []

    def take(self, device: torch.device) -> list[torch.Tensor]:
        return []

    def take_ranges(self, device: torch.device) -> list[torch.Tensor]:
        return []

    def take_flops(self) -> int:
        flops, self.flops = self.flops, 0
        return flops


def plan_for(fqn: str, module: nn.Module, shadow_format: str = "hybrid") -> LayerPlan:
    """The :class:`LayerPlan` for one layer, asking the backend that owns it
    (:func:`fp8track.execution.backends.backend_of`) how it quantises.

    * Delayed scaling: activation and weight are judged with the scales the forward just used, the
      gradient with the scale the backward is about to use (the backend's ``scale_fns``: emulated
      ``fp8_scales()`` and its gradient scaler; TE's ``fp8_meta``, which TE updates when autocast
      exits, after the hooks have run). TE's recipe is its ``fp8_meta["recipe"]``, which TE
      creates in the first forward: call this lazily.
    * Current scaling (emulated, torchao tensorwise, TE current): the same rule on the same tensor,
      ``M / amax / 2**margin``, so the monitor's scale is the backend's. TE's current and block
      scaling have no margin and follow ``NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES`` /
      ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES``; torchao's rowwise variants are judged tensor-wise
      (a documented approximation).
    * Block recipes (MXFP8, 128 blocks): the monitor re-derives the block scales with the
      functions the emulated backend uses.
    * Anything not in FP8 (plain or fallback layers, the bf16 recipe): shadow mode.
    """
    backend = backend_of(module)
    if backend is None or not backend.is_fp8(module) or getattr(module, "fp8", None) is False:
        # (TE sets ``module.fp8`` in ``init_fp8_metadata``: False when it ran outside FP8 autocast.)
        return shadow_plan(fqn, shadow_format)
    formats = {t: backend.format_for(module, t) for t in TENSOR_KINDS}
    rule = backend.scale_rule(module)
    if rule.scaling == "nvfp4":
        return LayerPlan(fqn, True, formats, scaling="nvfp4", nvfp4=rule.nvfp4)
    if rule.scaling in BLOCK_SCALINGS:
        return LayerPlan(
            fqn, True, formats, scaling=rule.scaling, margin=rule.margin, power_2_scales=rule.power_2_scales
        )
    scale_fns = backend.scale_fns(module) if rule.scaling == "delayed" else {}
    return LayerPlan(
        fqn, True, formats, scaling="per_tensor", scale_fns=scale_fns, margin=rule.margin,
        power_2_scales=rule.power_2_scales,
    )
