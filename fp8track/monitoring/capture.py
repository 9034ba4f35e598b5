"""Forward/backward hooks that turn a layer's GEMM operands into statistics partials.

For every chosen layer, on sampled steps only, the hooks see:

* ``activation``: the forward GEMM input (the layer's first positional input);
* ``weight``: the layer's weight in GEMM orientation ``[out, in]`` (``Conv1D``'s ``[in, out]``
  weight is seen transposed, which changes no per-tensor statistic and blocks block recipes along
  the reduction dimension as the GEMM does), once per sampled step;
* ``gradient``: dY, the gradient of the layer's output (a tensor hook on the output, which fires
  before the layer's own backward in every case).

Each observation becomes a device-side partial (``fp8track.numerics.stats``) merged into the layer's
accumulator for the step: micro-batches combine exactly and nothing waits for the device.
Per-tensor observations wait in the monitor's :class:`~fp8track.monitoring.stats_batch.StatsBatch`
until their hook phase ends and are computed together (one grouped pass per phase); no tensor is
kept past its phase. The scale a tensor is judged with comes from the layer's :class:`LayerPlan`:
the backend's own scale where it exposes one (delayed scaling), else the recipe's rule applied to
the tensor itself (current or block scaling), or current scaling for BF16 layers (shadow mode:
what FP8 would do to them).

Compiled models (``torch.compile``): the forward hook stays registered while the capture is
attached and reads one flag, ``active``; dynamo guards on it, so a compiled model keeps two
graphs (unsampled: no trace of the hook; sampled: a graph break into the capture, which runs
eagerly and calls the statistics kernel's own compiled code) and switches between them without
recompiling. Dynamo does not guard on hooks by default, so the first attach turns those guards on
(:func:`guard_module_hooks`): a graph traced without the hook is never reused for a hooked module.

Activation checkpointing: a forward that runs inside backward is a recompute
(:mod:`fp8track.execution.checkpointing`); each layer skips as many recomputes as it observed
forwards this step, so non-reentrant checkpointing counts the original forward and reentrant
checkpointing (whose first forward runs without grad) the recompute: each GEMM once per step.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from fp8track.errors import ConfigError, as_names, invalid_choice
from fp8track.execution.backends import backend_of
from fp8track.execution.backends import te as te_backend
from fp8track.execution.checkpointing import in_backward
from fp8track.execution.experts import MOE_KEYWORDS
from fp8track.execution.fallback import moe_keyword_layers
from fp8track.execution.layers import (
    GEMM_LAYER_KINDS,
    gemm_layers,
    gemm_weight,
    hidden_gemms,
    match_layers,
    preview_names,
)
from fp8track.monitoring.naming import canonical_layer_names
from fp8track.monitoring.sharding import ShardSpec, Share, is_dtensor, observed_weight, share_of
from fp8track.monitoring.stats_batch import StatsBatch
from fp8track.numerics.formats import TENSOR_KINDS, get_format_pair
from fp8track.numerics.nvfp4 import NVFP4_BLOCK, NVFP4Recipe, blockwise_dynamic_ranges, new_generator
from fp8track.numerics.scaling import BLOCK_LAYOUTS, BLOCK_SCALINGS, amax, block_layout, current_scale
from fp8track.numerics.stats import (
    block_partial_stats,
    empty_partial,
    identity_partial,
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
    fmt = _fp8_format(plan, tensor)
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


def _fp8_format(plan: LayerPlan, tensor: str) -> str:
    """The FP8 format FP8 what-ifs of ``plan`` use (E4M3 for an NVFP4 layer's E2M1 operands)."""
    fmt = plan.formats[tensor]
    return "e4m3" if fmt == "e2m1" else fmt


def variant_format(plan: LayerPlan, tensor: str, variant: str) -> str:
    """The element format a ``(tensor, variant)`` row of ``plan`` is finalised with."""
    base = variant.removesuffix("_columnwise")
    if base == "nvfp4" or (base in ("actual", "shadow") and plan.scaling == "nvfp4"):
        return "e2m1"
    return _fp8_format(plan, tensor)


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


def guard_module_hooks() -> None:
    """Make dynamo guard on modules' hooks, once per process, and drop what it compiled without.

    By default (``torch._dynamo.config.skip_nnmodule_hook_guards``, documented as unsafe) a graph
    traced for a module without hooks is reused after a hook is added, and for any other instance
    of the same class: the monitor's hooks would silently never run on a model compiled before
    it attached, or on a second model (a sweep's control) compiled alongside. With hook guards on,
    a monitored module gets its own graphs; the code caches compiled before are dropped once
    (they recompile on their next call), since they were traced without those guards.
    """
    config = torch._dynamo.config
    if getattr(config, "skip_nnmodule_hook_guards", False):
        config.skip_nnmodule_hook_guards = False
        getattr(torch._dynamo, "reset_code_caches", torch._dynamo.reset)()


LayerFilter = Callable[[nn.Module, str], bool]


def select_layers(
    model: nn.Module,
    layers: str | Sequence[str] | LayerFilter | None = None,
) -> list[tuple[str, nn.Module]]:
    """The GEMM layers to monitor (:func:`~fp8track.execution.layers.is_gemm_layer`), in registration
    order, under their canonical names (:func:`fp8track.monitoring.naming.canonical_layer_names`:
    wrappers and a LightningModule's holder attribute dropped), the names every record carries.

    Args:
        layers: ``None`` (every GEMM layer), one selector term or a list of them (see
            :func:`~fp8track.execution.layers.match_layers`: ``re:PATTERN`` searched in the
            qualified name, or the qualified name of a layer or of a module holding layers; the
            canonical or the full name; the mixture-of-experts keywords ``experts``, ``router``,
            ``shared_experts``; ``<experts>.<param>`` picks its experts module), or a
            ``(module, fqn) -> bool`` filter (full names).

    Raises:
        ConfigError: when the model has no GEMM layer, or a term matches none (the message lists
            candidates).
    """
    candidates = gemm_layers(model)
    hidden = hidden_gemms(model)
    if hidden:
        warnings.warn(
            f"fp8track: {len(hidden)} attention modules ({preview_names(list(hidden), 4)}) "
            "are not monitored: "
            + next(iter(hidden.values())),
            stacklevel=3,
        )
    if not candidates:
        raise ConfigError(
            f"{type(model).__name__} has no linear layer to monitor ({'; '.join(GEMM_LAYER_KINDS)})"
        )
    raw = [fqn for fqn, _ in candidates]
    names = canonical_layer_names(model, raw)
    canonical = dict(zip(raw, names, strict=True))
    if layers is None:
        picked = set(names)
    elif callable(layers):
        picked = {canonical[fqn] for fqn, m in candidates if layers(m, fqn)}
        if not picked:
            raise ConfigError(f"the layer filter matched none of the linear layers: {preview_names(names)}")
    else:
        picked = set()
        for term in [layers] if isinstance(layers, str) else list(layers):
            if not isinstance(term, str):
                raise ConfigError(f"layer selectors must be strings or a callable, got {term!r}")
            if term in MOE_KEYWORDS:  # experts / router / shared_experts
                picked.update(canonical[n] for n in moe_keyword_layers(model, term, raw))
                continue
            try:
                picked.update(match_layers(model, term, names))
            except ConfigError as err:  # a full name (with its holder or wrappers) names the same layers
                try:
                    picked.update(canonical.get(n, n) for n in match_layers(model, term, raw))
                except ConfigError:
                    raise err from None
    # <experts>.<param> picks its experts module (whose capture records every projection)
    picked |= {n.rpartition(".")[0] for n in picked}
    return [(canonical[fqn], m) for fqn, m in candidates if canonical[fqn] in picked]


def validate_tensors(tensors: Iterable[str]) -> tuple[str, ...]:
    tensors = as_names(tensors)  # "activation" is ("activation",), not its letters
    if not tensors:
        raise ConfigError(f"tensors must name at least one of {TENSOR_KINDS}")
    for t in tensors:
        if t not in TENSOR_KINDS:
            raise invalid_choice("tensor kind", t, TENSOR_KINDS)
    return tensors


def validate_whatif(whatif: Iterable[str]) -> tuple[str, ...]:
    whatif = as_names(whatif)  # "mxfp8" is ("mxfp8",)
    for v in whatif:
        if v not in WHATIF_VARIANTS:
            raise invalid_choice("what-if variant", v, WHATIF_VARIANTS)
    return whatif


def shadow_plan(fqn: str, fmt_pair: str = "hybrid") -> LayerPlan:
    """Plan for a BF16 layer: current scaling in ``fmt_pair`` (what FP8 would do to it)."""
    pair = get_format_pair(fmt_pair)
    formats = {t: pair.for_tensor(t).name for t in TENSOR_KINDS}
    return LayerPlan(fqn=fqn, fp8=False, formats=formats)


class LayerCapture:
    """Hooks and per-step accumulators of one layer.

    ``partials[(tensor, variant)]`` is the merged partial of the current sampled step (or absent).

    ``plan`` may be a function returning the :class:`LayerPlan`: it is then resolved at the first
    observation of a sampled step (after the layer's forward ran, when every backend has built
    its state, e.g. TE's lazily created ``fp8_meta``) or when the keys are first needed.
    ``hooks=False`` registers no module hook: observations come from elsewhere (TE's debug API,
    :mod:`fp8track.monitoring.te_capture`) through :meth:`observe`.
    """

    def __init__(
        self,
        module: nn.Module,
        plan: LayerPlan | Callable[[], LayerPlan],
        tensors: Sequence[str],
        whatif: Sequence[str],
        sharding: ShardSpec | None = None,
        *,
        hooks: bool = True,
        collective_timeout_s: float | None = None,
    ) -> None:
        self.module = module
        self.sharding = sharding
        self.collective_timeout_s = collective_timeout_s
        self._plan: LayerPlan | None = plan if isinstance(plan, LayerPlan) else None
        self._resolve = None if isinstance(plan, LayerPlan) else plan
        self.tensors = tuple(tensors)
        self._whatif_asked = tuple(whatif)
        self.hooks = hooks
        backend = backend_of(module)
        self.te = backend is not None and backend.debug_api  # TE: tuple outputs, FP8 primary weights
        self.active = False
        self._weight_done = False
        self._forwards = 0  # training forwards observed this step (outside backward)
        self._recomputes = 0  # forwards run inside backward this step and taken as their recompute
        self._resting_weight: torch.Tensor | None = None
        self.partials: dict[tuple[str, str], torch.Tensor] = {}
        self.count_tokens = False  # one expert of a module-list MoE: its rows carry ``tokens``
        # Block rows' max_blockwise_dynamic_range this step, merged by max (0-d float64 on device).
        self.ranges: dict[tuple[str, str], torch.Tensor] = {}
        self.flops = 0  # GEMM FLOPs (forward + both backward GEMMs) seen since the last take_flops
        # Called with (tensor, x, scale used or None) for every observation while set: the
        # monitor's tensor dumps (fp8track.monitoring.dumps).
        self.recorder: Callable[[str, torch.Tensor, torch.Tensor | None], None] | None = None
        self._observations: list[tuple[str, str | None]] | None = None  # after the plan resolves
        # The monitor's batch: per-tensor observations computed together at the end of each hook
        # phase (fp8track.monitoring.stats_batch); None computes each at once.
        self.batch: StatsBatch | None = None
        self._range_rows: dict[str, list[tuple[str, RangeSpec]]] = {}
        # The forward hook stays registered while attached, sampled step or not: a compiled model
        # guards on a module's hooks, so adding one per sampled step would recompile.
        self._attached = False
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    @property
    def plan(self) -> LayerPlan:
        if self._plan is None:
            assert self._resolve is not None
            self._plan = self._resolve()
        return self._plan

    @property
    def whatif(self) -> tuple[str, ...]:
        plan = self.plan
        return tuple(
            v
            for v in self._whatif_asked
            if not (v == "current" and plan.scaling == "per_tensor" and not plan.fp8)
            and not (v == plan.scaling and plan.fp8)
        )

    def _observation_list(self) -> list[tuple[str, str | None]]:
        """``(variant, what-if scaling)`` pairs observed per tensor; built once the plan is resolved."""
        if self._observations is None:
            plan = self.plan
            obs: list[tuple[str, str | None]] = [(plan.variant, None), *((v, v) for v in self.whatif)]
            for variant, scaling in list(obs):
                s = scaling or plan.scaling
                if s in COLUMNWISE_SCALINGS:
                    obs.append((f"{variant}_columnwise", f"{s}_columnwise"))
            self._observations = obs
        return self._observations

    def extra_stats(self, tensor: str, stats: dict[str, float]) -> None:
        """Add ``tokens`` (rows seen: ``numel`` over the row width) to an activation / gradient row
        of one expert's linear (:attr:`count_tokens`), as the fused experts' rows carry it."""
        w = gemm_weight(self.module) if self.count_tokens else None
        if w is not None and tensor in ("activation", "gradient"):
            stats["tokens"] = stats["numel"] / int(w.shape[1] if tensor == "activation" else w.shape[0])

    def keys(self) -> list[tuple[str, str]]:
        """Every (tensor, variant) this layer reports, in a fixed order (same on every rank)."""
        variants = [v for v, _ in self._observation_list()]
        return [(t, v) for t in self.tensors for v in variants]

    def range_keys(self) -> list[tuple[str, str]]:
        """The :meth:`keys` whose rows carry ``max_blockwise_dynamic_range`` (block rows), in order."""
        return [(t, v) for t in self.tensors for v, sc in self._observation_list()
                if block_range_spec(self.plan, t, v, sc) is not None]

    def take_ranges(self, device: torch.device) -> list[torch.Tensor]:
        """The step's ``max_blockwise_dynamic_range`` per :meth:`range_keys` (``-inf`` where nothing
        was seen); resets."""
        keys = self.range_keys()
        if not keys:  # per-tensor rows only: no tensor made
            self.ranges.clear()
            return []
        none = torch.full((), -math.inf, dtype=torch.float64, device=device)
        out = [none if (r := self.ranges.get(k)) is None else r.to(device) for k in keys]
        self.ranges.clear()
        return out

    def attach(self) -> None:
        self._attached = True
        self._sync_hooks()

    def detach(self) -> None:
        # A compiled graph traced with the hook may still call it (before dynamo's hook guards
        # notice the removal): inactive, it returns at once.
        self._attached = False
        self.active = False
        self._sync_hooks()

    def begin_step(self, sampled: bool) -> None:
        self.active = sampled
        self._weight_done = False
        self._forwards = self._recomputes = 0
        # Between steps FSDP2 holds the high-precision shard; the forward may see an FP8 all-gather.
        self._resting_weight = getattr(self.module, "weight", None) if sampled else None

    def _sync_hooks(self) -> None:
        want = self.hooks and self._attached
        if want and not self._handles:
            guard_module_hooks()
            # First in line: under tensor parallelism the output is still a DTensor (its gradient then
            # tells its placement) before parallelize_module's own hook turns it into a local tensor.
            self._handles.append(self.module.register_forward_hook(self._forward_hook, prepend=True))
        elif not want and self._handles:
            for h in self._handles:
                h.remove()
            self._handles.clear()

    def take(self, device: torch.device) -> list[torch.Tensor]:
        """The step's partials in :meth:`keys` order (empty partials where nothing was seen); resets."""
        if self.batch is not None:
            self.batch.flush()
        empty = identity_partial(device)  # shared and read only: the flush stacks (copies) these
        out = [empty if (p := self.partials.get(k)) is None else p.to(device) for k in self.keys()]
        self.partials.clear()
        return out

    def take_flops(self) -> int:
        """GEMM FLOPs of the forwards observed since the last call (``6 * tokens * in * out`` per
        forward: the forward GEMM and both backward GEMMs), from shapes only; resets."""
        flops, self.flops = self.flops, 0
        return flops

    def wants(self, tensor: str) -> bool:
        """Whether an observation of ``tensor`` now would be recorded (sampled step, tracked tensor,
        weight not yet seen this step)."""
        return self.active and tensor in self.tensors and not (tensor == "weight" and self._weight_done)

    def observe(self, tensor: str, x: torch.Tensor, actual: torch.Tensor | None = None) -> None:
        """Add one observation of ``tensor`` (no-op outside sampled steps). ``actual`` is the
        partial of what the backend really did, when the caller knows it (TE's debug API hands
        the quantizer); else the plan derives it. What-if variants always come from the plan."""
        if not self.wants(tensor):
            return  # the weight once per sampled step, as the hooks do (micro-batches see the same one)
        if tensor == "weight":
            self._weight_done = True
        with torch.no_grad():
            self._add(tensor, x, actual)

    def _add(self, tensor: str, x: torch.Tensor, actual: torch.Tensor | None = None) -> None:
        x = x.detach()
        share = share_of(x, tensor, self.sharding, self.collective_timeout_s)
        if self.recorder is not None and actual is None:
            fn = self.plan.scale_fns.get(tensor) if self.plan.scaling == "per_tensor" else None
            self.recorder(tensor, share.local, fn() if fn is not None else None)
        partials, plan, batch = self.partials, self.plan, self.batch
        # (a dumped observation is recomputed from the dump by the per-tensor path: it takes it here)
        if batch is not None and not (actual is None and share.trivial and batch.accepts(x)) or (
            is_dtensor(x) or self.recorder is not None
        ):
            batch = None
        for variant, scaling in self._observation_list():
            key = (tensor, variant)
            if actual is not None and variant == plan.variant:
                prev = partials.get(key)
                partials[key] = actual if prev is None else merge_partials([prev, actual])
                continue
            per_tensor = (scaling or plan.scaling) in ("per_tensor", "current") and not plan.power_2_scales
            if batch is not None and per_tensor:
                fn = plan.scale_fns.get(tensor) if scaling is None else None
                fmt = _fp8_format(plan, tensor)
                batch.add(partials, key, share.local, fmt, fn() if fn else None, plan.margin)
                continue
            partials[key] = tensor_partial(
                share.local, plan, tensor, scaling, share, into=partials.get(key)
            )
        self._add_ranges(tensor, share.local)

    def _add_ranges(self, tensor: str, x: torch.Tensor) -> None:
        """Merge ``x``'s ``max_blockwise_dynamic_range`` into every block row of ``tensor`` (``|x|``
        prepared once, each block shape reduced once:
        :func:`~fp8track.numerics.nvfp4.blockwise_dynamic_ranges`). Under sharding each rank
        measures its local tensor and the flush's MAX collective takes the largest."""
        rows = self._range_rows.get(tensor)
        if rows is None:  # once per tensor kind (the plan is fixed once resolved)
            rows = self._range_rows[tensor] = [
                (v, spec) for v, sc in self._observation_list()
                if (spec := block_range_spec(self.plan, tensor, v, sc)) is not None
            ]
        if not rows or x.dim() < 1 or x.shape[-1] == 0:
            return
        values = blockwise_dynamic_ranges(x, [spec for _, spec in rows])
        for (variant, _), value in zip(rows, values, strict=True):
            value = value.to(torch.float64)
            prev = self.ranges.get((tensor, variant))
            self.ranges[(tensor, variant)] = value if prev is None else torch.maximum(prev, value)

    def _forward_hook(self, module: nn.Module, args: tuple, output: object) -> None:
        # Under torch.compile dynamo traces this test and nothing else: it guards on ``self.active``
        # (a constant to it), so a compiled model holds one graph for unsampled steps, with no trace
        # of the hook, and one that breaks into :meth:`_capture` here, and switches between them
        # without recompiling. Evaluation passes (no grad) between steps are not observed.
        # (Always through the disabled wrapper: under torch.compile, a hook run eagerly after a graph
        # break is still a frame dynamo would compile.)
        if self.active and torch.is_grad_enabled():
            self._capture(module, args, output)

    @torch.compiler.disable
    def _capture(self, module: nn.Module, args: tuple, output: object) -> None:
        """The forward's observations, run outside any compiled graph (the statistics kernel is
        compiled on its own); a recompute of an already observed forward is skipped."""
        if self._is_recompute():
            return
        with torch.no_grad():
            self._observe_forward(module, args)
        if isinstance(output, tuple) and output and self.te:
            output = output[0]  # TE's return_bias=True gives (out, bias) (TransformerLayer's proj)
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and isinstance(output, torch.Tensor) and x.dim() and output.dim():
            self.flops += 6 * x.numel() * output.shape[-1]  # tokens * in = numel
        if isinstance(output, torch.Tensor) and output.requires_grad:
            if "gradient" in self.tensors:
                output.register_hook(self._gradient_hook)
            elif self.batch is not None:  # the backward's start ends the forward's batch
                output.register_hook(self._phase_hook)

    def _is_recompute(self) -> bool:
        """Whether this forward recomputes one already observed this step (activation checkpointing).

        A forward that runs inside a backward pass is a recompute. Non-reentrant checkpointing
        (``use_reentrant=False``, Hugging Face's default) first ran the region with grad enabled,
        so that forward was observed: skip the recompute, as many times as forwards were observed.
        Reentrant checkpointing ran it under ``no_grad`` (not observed): its recompute, the only
        forward that builds a graph (and whose dY reaches the hook), is the one observed.
        """
        if not in_backward():
            self._forwards += 1
            return False
        if self._recomputes < self._forwards:
            self._recomputes += 1
            return True
        return False

    def _observe_forward(self, module: nn.Module, args: tuple) -> None:
        if "activation" in self.tensors and args and isinstance(args[0], torch.Tensor):
            self._add("activation", args[0])
        if "weight" in self.tensors and not self._weight_done:
            weight = gemm_weight(
                module, observed_weight(getattr(module, "weight", None), self._resting_weight)
            )
            if weight is not None and not (self.te and te_backend.is_quantized_tensor(weight)):
                # (TE FP8 primary weights hold no high-precision copy: no row rather than statistics
                # of a silent dequantisation.)
                self._add("weight", weight)
                self._weight_done = True

    @torch.no_grad()
    def _gradient_hook(self, grad: torch.Tensor) -> None:
        if self.batch is not None:
            self.batch.backward_started()
        self._add("gradient", grad)

    def _phase_hook(self, grad: torch.Tensor) -> None:
        if self.batch is not None:
            self.batch.backward_started()


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
