"""Per-expert statistics of mixture-of-experts layers.

For every fused expert group (:mod:`fp8track.execution.experts`) and projection ``<param>``, on
sampled steps, rows named

* ``<experts>.<param>.expert_<e>``: expert ``e``'s activation (its routed tokens, the rows of the
  grouped GEMM's input in its group), weight (its slice ``[out, in]``) and gradient (its dY rows),
  each judged with that expert's own scale (one quantizer per expert, as Transformer Engine's
  ``GroupedLinear``); an expert that got no token has no activation or gradient row;
* ``<experts>.<param>``: the group's aggregate, the expert partials merged as shards of one tensor
  merge (counts summed, maxima maxed).

Activation and gradient rows carry ``tokens``: the routed (token, expert) slots of the step
(all tokens for Llama 4's dense experts).

The statistics of all experts of a projection come from one pass over the grouped tensor
(:func:`fp8track.numerics.segment_stats.segment_partial_stats`, group boundaries from the GEMM's
own offsets on the device): no Python loop over experts, no host synchronisation.

Where the GEMMs are seen:

* a converted module (:class:`fp8track.execution.fp8_experts.EmulatedFP8Experts`) calls the
  capture's tap once per projection with the rows, offsets and output;
* an unconverted Hugging Face module (a BF16 control, shadow statistics) is watched during its
  forward on sampled steps by a ``TorchFunctionMode`` that sees its ``torch._grouped_mm`` calls
  (``F.grouped_mm``, the default ``grouped_mm`` implementation, or transformers' fallback op for
  it, which runs under ``torch.compile`` with float32 weights) or ``torch.bmm`` calls (Llama 4),
  matched to the parameter by storage. The ``eager`` and ``batched_mm`` implementations loop or
  gather weights per slot; those groups get no rows, with a warning saying why. Their FLOPs (for
  the FP8 FLOP share) are counted from the routing the module receives (``top_k_index``: one row
  per routed slot per projection), whatever the implementation, so the share stays the executed one.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from fp8track.execution.checkpointing import RecomputeFilter
from fp8track.execution.experts import (
    ROUTER_REASON,
    ExpertGroup,
    ExpertParam,
    expert_row,
    plain_weight,
    torchao_training_config,
)
from fp8track.execution.fp8_experts import EmulatedFP8Experts
from fp8track.execution.grouped import equal_offsets, segment_ids
from fp8track.monitoring.capture import guard_module_hooks
from fp8track.monitoring.plans import LayerPlan, shadow_plan
from fp8track.numerics.formats import TENSOR_KINDS
from fp8track.numerics.scaling import BLOCK_SCALINGS, block_layout
from fp8track.numerics.segment_stats import (
    expert_tile_partial_stats,
    merge_group_partials,
    segment_block_partial_stats,
    segment_partial_stats,
)
from fp8track.numerics.stats import identity_partial, merge_partials

TOKENS_STAT = "tokens"
"""Extra statistic of expert activation and gradient rows: routed (token, expert) slots."""
_GROUPED_OPS = (torch._grouped_mm, *((F.grouped_mm,) if hasattr(F, "grouped_mm") else ()))
_HF_GROUPED_FALLBACK = "transformers.grouped_mm_fallback"
"""transformers' own grouped GEMM custom op (same operands as ``grouped_mm``), which its
``grouped_mm`` implementation calls where ``torch._grouped_mm`` cannot run: under ``torch.compile``
with weights other than BF16, and on CPU with torch <= 2.10 for unaligned tensors."""


def _is_grouped_op(func: Any) -> bool:
    return func in _GROUPED_OPS or str(func).removesuffix(".default") == _HF_GROUPED_FALLBACK


class ExpertRowCapture:
    """One record row source of an expert group (``<experts>.<param>[.expert_<e>]``) with the
    interface the monitor asks of a layer capture (keys, take, FLOPs); the group fills it."""

    def __init__(
        self,
        group: ExpertGroupCapture,
        plan: LayerPlan,
        param: str,
        expert: int | None,
        width: dict[str, int],
    ) -> None:
        self.group = group
        self.plan = plan
        self.param = param
        self.expert = expert  # None: the group's aggregate row
        self.tensors = group.tensors
        self.module = group.module
        self.width = width  # the row width (K) of each tensor kind, to count tokens
        self.flops = 0
        self.active = False
        self.recorder: Callable[[str, torch.Tensor, torch.Tensor | None], None] | None = None  # no dumps

    def keys(self) -> list[tuple[str, str]]:
        return [(t, self.plan.variant) for t in self.tensors]

    def range_keys(self) -> list[tuple[str, str]]:
        return []

    def take_ranges(self, device: torch.device) -> list[torch.Tensor]:
        return []

    def take(self, device: torch.device) -> list[torch.Tensor]:
        """This row's partials of the step (the group's ``[E + 1, 13]`` accumulators hold every row)."""
        empty = identity_partial(device)
        out = []
        for t in self.tensors:
            acc = self.group.partials.get((self.param, t))
            row = self.group.group.num_experts if self.expert is None else self.expert
            out.append(empty if acc is None else acc[row].to(device))
        return out

    def take_flops(self) -> int:
        flops, self.flops = self.flops, 0
        return flops

    def extra_stats(self, tensor: str, stats: dict[str, float]) -> None:
        """Add ``tokens`` to an activation / gradient row's finalised statistics."""
        if tensor in ("activation", "gradient") and self.width.get(tensor):
            stats[TOKENS_STAT] = stats["numel"] / self.width[tensor]

    def begin_step(self, sampled: bool) -> None:
        self.active = sampled
        self.group.begin_step(sampled)

    def attach(self) -> None:
        self.group.attach()

    def detach(self) -> None:
        self.group.detach()


class _Spy(TorchFunctionMode):
    """Sees an unconverted experts module's grouped GEMMs (see the module docstring)."""

    def __init__(self, capture: ExpertGroupCapture) -> None:
        super().__init__()
        self.capture = capture

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _is_grouped_op(func) and len(args) >= 2:
            offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
            param = self.capture.param_of(args[1])
            if param is not None and offs is not None and args[0].dim() == 2:
                self.capture.tap(param.name, args[0], offs, out, count_flops=False)  # pre-hook counts
        elif func is torch.bmm and len(args) == 2 and args[0].dim() == 3:
            param = self.capture.param_of(args[1])
            if param is not None:
                e, t, k = args[0].shape
                self.capture.tap(param.name, args[0].reshape(e * t, k), equal_offsets(e, t, args[0].device),
                                 out.reshape(e * t, -1))
        return out


class ExpertGroupCapture:
    """Hooks on one experts module and its rows (see the module docstring).

    Args:
        name: the group's canonical name (records use it).
        module: the experts module.
        group: its structure.
        tensors: the tensor kinds to record.
        shadow_format: format pair of shadow statistics (unconverted groups).
    """

    def __init__(
        self, name: str, module: nn.Module, group: ExpertGroup, tensors: Sequence[str], shadow_format: str
    ) -> None:
        self.name = name
        self.module = module
        self.group = group
        self.tensors = tuple(tensors)
        self.shadow_format = shadow_format
        self.active = False
        self._attached = False
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._spy: _Spy | None = None
        self._weights_done: set[str] = set()
        self._recompute = RecomputeFilter()
        self._warned = False
        self.rows: dict[str, ExpertRowCapture] = {}
        self.counts: torch.Tensor | None = None  # routed slots per expert this step (first projection)
        # (param, tensor) -> [E + 1, PARTIAL_SIZE]: the experts' partials, then the aggregate.
        self.partials: dict[tuple[str, str], torch.Tensor] = {}
        self.plans: dict[str, LayerPlan] = {}
        for p in group.params:
            fp8 = isinstance(module, EmulatedFP8Experts) and p.name in module.fp8_params
            plan = self.plans[p.name] = self._plan(p, fp8)
            w = p.weight_oi(module)
            width = {"activation": int(w.shape[2]), "gradient": int(w.shape[1])}
            for e in [None, *range(group.num_experts)]:
                row = expert_row(name, p.name, e)
                self.rows[row] = ExpertRowCapture(
                    self, LayerPlan(row, plan.fp8, plan.formats), p.name, e, width
                )

    def _plan(self, param: ExpertParam, fp8: bool) -> LayerPlan:
        torchao = torchao_training_config(self.module) if self.group.kind == "torchao" else None
        if torchao is not None:
            return torchao_plan(self.name, torchao)
        if not fp8:
            return shadow_plan(self.name, self.shadow_format)
        assert isinstance(self.module, EmulatedFP8Experts)
        recipe = self.module.fp8_recipe
        formats = {t: recipe.formats.for_tensor(t).name for t in TENSOR_KINDS}
        scaling = recipe.scaling if recipe.scaling in BLOCK_SCALINGS else "per_tensor"
        return LayerPlan(self.name, True, formats, scaling=scaling)

    # -- lifecycle -------------------------------------------------------------------------------
    def attach(self) -> None:
        if self._attached:
            return
        self._attached = True
        guard_module_hooks()
        self._handles = [
            self.module.register_forward_pre_hook(self._pre_hook, with_kwargs=True),
            self.module.register_forward_hook(self._post_hook),
        ]

    def detach(self) -> None:
        self._attached = False
        self.active = False
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def begin_step(self, sampled: bool) -> None:
        """Called by each of the group's rows; the first call of a step resets the step's state."""
        if sampled != self.active or not sampled:
            self._weights_done.clear()
            self._recompute.reset()
            self.counts = None
            self.partials.clear()
        self.active = sampled

    def take_counts(self) -> torch.Tensor | None:
        counts, self.counts = self.counts, None
        return counts

    # -- hooks -----------------------------------------------------------------------------------
    def _pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not (self.active and torch.is_grad_enabled()) or self._recompute.is_recompute():
            return
        if isinstance(module, EmulatedFP8Experts):
            module.fp8track_tap = self.tap
            return
        if self.group.kind != "dense":
            self._count_routed_flops(args, kwargs)
        impl = getattr(getattr(module, "config", None), "_experts_implementation", "grouped_mm")
        if self.group.kind != "dense" and impl not in (None, "grouped_mm") and not self._warned:
            self._warned = True
            warnings.warn(
                f"fp8track: {self.name} runs experts implementation {impl!r}; per-expert statistics "
                "need 'grouped_mm' (transformers' default) or an apply_fp8-converted module",
                stacklevel=2,
            )
        self._spy = _Spy(self)
        self._spy.__enter__()

    def _count_routed_flops(self, args: tuple, kwargs: dict) -> None:
        """FLOPs of an unconverted routed group from its routing (``top_k_index``, the first integer
        tensor after the hidden states): every slot is one row of each projection's GEMM, whichever
        implementation runs them (the spy sees only ``grouped_mm``'s; ``eager`` loops over experts,
        ``batched_mm`` gathers weights per slot)."""
        index = next(
            (a for a in (*args[1:], *kwargs.values())
             if isinstance(a, torch.Tensor) and not a.is_floating_point() and not a.is_complex()),
            None,
        )
        if index is None:
            return
        slots = int(index.numel())  # the shape only: no host synchronisation
        for p in self.group.params:
            w = p.weight_oi(self.module)
            self.rows[expert_row(self.name, p.name)].flops += 6 * slots * int(w.shape[1]) * int(w.shape[2])

    def _post_hook(self, module: nn.Module, args: tuple, output: object) -> None:
        if isinstance(module, EmulatedFP8Experts):
            module.fp8track_tap = None
        if self._spy is not None:
            spy, self._spy = self._spy, None
            spy.__exit__(None, None, None)

    def param_of(self, weight: torch.Tensor) -> ExpertParam | None:
        """The projection whose parameter ``weight`` is (or views)."""
        if not isinstance(weight, torch.Tensor):
            return None
        ptr = plain_weight(weight).data_ptr()
        for p in self.group.params:
            w = plain_weight(getattr(self.module, p.name))
            if ptr == w.data_ptr() and weight.shape[0] == w.shape[0]:
                return p
        return None

    # -- observations ----------------------------------------------------------------------------
    @torch.no_grad()
    def tap(
        self, param: str, rows: torch.Tensor, offs: torch.Tensor, out: torch.Tensor, count_flops: bool = True
    ) -> None:
        """One grouped GEMM of projection ``param``: ``rows [S, K]`` (sorted by expert), ``offs``
        the cumulative row counts, ``out [S, N]`` its output (dY is read from its gradient).
        ``count_flops=False``: the GEMM's FLOPs were counted from the routing already."""
        p = next(x for x in self.group.params if x.name == param)
        e = self.group.num_experts
        seg = segment_ids(offs, rows.shape[0])
        w = p.weight_oi(self.module)
        if count_flops:
            flops = 6 * rows.shape[0] * int(w.shape[1]) * int(w.shape[2])
            self.rows[expert_row(self.name, param)].flops += flops
        if param == self.group.params[0].name:
            counts = torch.diff(offs.to(torch.float64), prepend=offs.new_zeros(1, dtype=torch.float64))
            self.counts = counts if self.counts is None else self.counts + counts
        if "activation" in self.tensors:
            self._add(param, "activation", rows, seg, self._scale(param, "activation"))
        if "weight" in self.tensors and param not in self._weights_done:
            self._weights_done.add(param)
            n = int(w.shape[1])
            if self.plans[param].scaling in BLOCK_SCALINGS:  # each expert's slice, its own blocks / tiles
                plan = self.plans[param]
                layout = block_layout(plan.scaling, "weight")
                parts = expert_tile_partial_stats(w.detach(), layout, plan.formats["weight"])
                self._merge(param, "weight", parts)
            else:
                wseg = torch.arange(e, device=w.device).repeat_interleave(n)
                self._add(param, "weight", w.detach().reshape(e * n, -1), wseg, self._scale(param, "weight"))
        if "gradient" in self.tensors and out.requires_grad:
            scale_fn = self._gradient_scale_fn(param)
            out.register_hook(lambda g: self._gradient(param, g, seg, scale_fn))

    def _scale(self, param: str, tensor: str) -> torch.Tensor | None:
        """The per-expert scales the converted module used for ``tensor`` (delayed scaling), else
        ``None`` (current scaling per expert: the same rule on the same rows)."""
        quant = self.module.fp8_quantizers(param) if isinstance(self.module, EmulatedFP8Experts) else None
        if quant is None or not quant.delayed:
            return None
        return quant.last_scales.get(tensor)

    def _gradient_scale_fn(self, param: str) -> Callable[[], torch.Tensor | None]:
        quant = self.module.fp8_quantizers(param) if isinstance(self.module, EmulatedFP8Experts) else None
        scaler = quant.delayed.get("gradient") if quant is not None else None
        if scaler is None:
            return lambda: None
        return lambda: scaler.scale.clone()  # dY is seen before the backward that uses this scale

    @torch.no_grad()
    def _gradient(self, param: str, g: torch.Tensor, seg: torch.Tensor, scale_fn: Callable[[], Any]) -> None:
        self._add(param, "gradient", g.reshape(-1, g.shape[-1]), seg, scale_fn())

    def _add(
        self, param: str, tensor: str, x2d: torch.Tensor, seg: torch.Tensor, scale: torch.Tensor | None
    ) -> None:
        plan = self.plans[param]
        if plan.scaling in BLOCK_SCALINGS:
            layout = block_layout(plan.scaling, tensor)
            parts = segment_block_partial_stats(
                x2d, seg, self.group.num_experts, layout, plan.formats[tensor]
            )
        else:
            parts = segment_partial_stats(
                x2d, seg, self.group.num_experts, plan.formats[tensor], scale, plan.margin
            )
        self._merge(param, tensor, parts)

    def _merge(self, param: str, tensor: str, parts: torch.Tensor) -> None:
        """Add the experts' partials ``[E, 13]`` of one observation, and their aggregate."""
        parts = torch.cat([parts, merge_group_partials(parts).unsqueeze(0)])
        prev = self.partials.get((param, tensor))
        self.partials[(param, tensor)] = parts if prev is None else merge_partials([prev, parts])


def torchao_plan(name: str, config: object) -> LayerPlan:
    """How torchao's MoE training quantises expert GEMMs: MXFP8 (``MXFP8TrainingOpConfig``: 1x32
    blocks, E4M3, E8M0 scales rounded up, the same rule as the ``mxfp8`` recipe; any other scale
    mode is judged by it too), or FP8 rowwise (``Float8TrainingOpConfig``: E4M3 with per-token and
    per-column scales, judged per expert tensor-wise, as the monitor judges torchao's rowwise
    linears: a documented approximation)."""
    formats = dict.fromkeys(TENSOR_KINDS, "e4m3")
    scaling = "mxfp8" if type(config).__name__.startswith("MXFP8") else "per_tensor"
    return LayerPlan(name, True, formats, scaling=scaling)


def not_fp8_reason(capture: object, why: Mapping[str, str]) -> str | None:
    """Why an MoE capture's GEMMs are not in FP8, from ``why`` (layer -> reason, from the apply
    report): an expert projection by its ``<experts>.<param>`` name or its experts module's; a
    router by its name, else the default that keeps it in high precision."""
    if isinstance(capture, ExpertRowCapture):
        group = capture.group.name
        return why.get(f"{group}.{capture.param}") or why.get(group)
    from fp8track.monitoring.router_capture import RouterCapture

    if isinstance(capture, RouterCapture):
        return why.get(capture.name) or f"kept in BF16: {ROUTER_REASON}"
    return None
