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
kept past its phase. The scale a tensor is judged with comes from the layer's
:class:`~fp8track.monitoring.plans.LayerPlan` (:mod:`fp8track.monitoring.plans`: the backend's own
scale, the recipe's rule, or shadow mode); which layers get a capture is
:mod:`fp8track.monitoring.selection`'s job.

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
from collections.abc import Callable, Sequence

import torch
from torch import nn

from fp8track.execution.backends import backend_of
from fp8track.execution.backends import te as te_backend
from fp8track.execution.checkpointing import RecomputeFilter
from fp8track.execution.layers import gemm_weight
from fp8track.monitoring.plans import (
    COLUMNWISE_SCALINGS,
    LayerPlan,
    RangeSpec,
    block_range_spec,
    fp8_format,
    tensor_partial,
)
from fp8track.monitoring.sharding import ShardSpec, is_dtensor, observed_weight, share_of
from fp8track.monitoring.stats_batch import StatsBatch
from fp8track.numerics.nvfp4 import blockwise_dynamic_ranges
from fp8track.numerics.stats import identity_partial, merge_partials


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


class LayerCapture:
    """Hooks and per-step accumulators of one layer.

    ``partials[(tensor, variant)]`` is the merged partial of the current sampled step (or absent).

    ``plan`` may be a function returning the :class:`~fp8track.monitoring.plans.LayerPlan`: it is
    then resolved at the first observation of a sampled step (after the layer's forward ran, when
    every backend has built its state, e.g. TE's lazily created ``fp8_meta``) or when the keys are
    first needed.
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
        self._recompute = RecomputeFilter()  # activation checkpointing's recomputes, per step
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
        self._recompute.reset()
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
        partials, plan = self.partials, self.plan
        # (a dumped observation is recomputed from the dump by the per-tensor path: it takes it here)
        shared = self.batch if (
            actual is None and share.trivial and not is_dtensor(x) and self.recorder is None
        ) else None
        batch = shared if shared is not None and shared.accepts(x) else None
        if shared is None and self.batch is not None:
            self.batch.merge_waiting()  # the accumulators below are read now, not at the phase end
        for variant, scaling in self._observation_list():
            key = (tensor, variant)
            prev = partials.get(key)
            if actual is not None and variant == plan.variant:
                partials[key] = actual if prev is None else merge_partials([prev, actual])
                continue
            per_tensor = (scaling or plan.scaling) in ("per_tensor", "current") and not plan.power_2_scales
            fn = plan.scale_fns.get(tensor) if per_tensor and scaling is None else None
            if batch is not None and per_tensor:
                fmt = fp8_format(plan, tensor)
                batch.add(partials, key, share.local, fmt, fn() if fn else None, plan.margin)
                continue
            if shared is not None and per_tensor and fn is None:  # current scaling: once per tensor
                shared.merge_current(partials, key, share.local, fp8_format(plan, tensor), plan.margin)
                continue
            partials[key] = tensor_partial(share.local, plan, tensor, scaling, share, into=prev)
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
        if self._recompute.is_recompute():
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
