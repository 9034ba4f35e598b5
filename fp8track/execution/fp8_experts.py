"""Fused expert modules in emulated FP8: the module keeps its class, parameters and names.

:func:`convert_experts` gives a fused experts module (:mod:`fp8track.execution.experts`) a
subclass of its own class whose ``forward`` runs each projection as an FP8 grouped GEMM with one
quantizer per expert (:func:`fp8track.execution.grouped.fp8_grouped_linear`; block recipes:
:func:`fp8track.execution.grouped_block.fp8_block_grouped_linear`). Parameters,
their names, ``state_dict`` keys and every other attribute stay as they were, so checkpoints load
into the converted model and the model's own code (``_apply_gate``, ``act_fn``, biases) still runs.

* Hugging Face fused experts (``@use_experts_implementation``): the forward is the library's
  ``grouped_mm`` implementation (``transformers.integrations.moe.grouped_mm_experts_forward``:
  the (token, expert) slots sorted by expert, ``histc`` counts, int32 offsets) with the two GEMMs
  in FP8. A converted module runs it whatever ``config._experts_implementation`` says.
* Llama 4's dense experts: every expert over every token (``Llama4TextExperts.forward``), the
  groups being equal slices of the tokens.

Every converted forward calls :attr:`EmulatedFP8Experts.fp8track_tap` (when set) once per
projection with ``(param name, input rows, offsets, output)``: the monitor's expert capture
(:mod:`fp8track.monitoring.expert_capture`) reads per-expert statistics from it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import nn

from fp8track.execution.experts import ExpertGroup, ExpertParam
from fp8track.execution.grouped import GROUPED_SCALINGS, GroupQuantizers, equal_offsets, fp8_grouped_linear
from fp8track.execution.grouped_block import fp8_block_grouped_linear
from fp8track.execution.recipes import Recipe
from fp8track.numerics.scaling import BLOCK_SCALINGS

Tap = Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor], None]


class EmulatedFP8Experts(nn.Module):
    """Mixin placed before a fused experts class (see the module docstring).

    Attributes:
        fp8_recipe: the recipe.
        fp8_group: the :class:`~fp8track.execution.experts.ExpertGroup` it was converted as.
        fp8_params: the projections that run FP8 (the others stay in their high precision).
        fp8track_tap: set by the monitor on sampled steps; ``None`` otherwise.
    """

    fp8_recipe: Recipe
    fp8_group: ExpertGroup
    fp8_params: tuple[str, ...]
    fp8track_tap: Tap | None
    _fp8_quant: dict[str, GroupQuantizers]

    def _init_fp8_experts(self, recipe: Recipe, group: ExpertGroup, fp8_params: Collection[str]) -> None:
        self.fp8_recipe = recipe
        self.fp8_group = group
        self.fp8_params = tuple(p.name for p in group.params if p.name in fp8_params)
        self.fp8track_tap = None
        self._fp8_quant = {n: GroupQuantizers(recipe, group.num_experts) for n in self.fp8_params}

    def __reduce_ex__(self, protocol: Any) -> Any:
        # The converted class is made at run time (convert_experts), so pickle cannot find it by
        # name: rebuild it from the experts class it derives from, then restore the state as
        # nn.Module's own pickling does (torch.save of the whole model).
        return _converted_instance, (type(self).__bases__[1],), self.__getstate__()

    def fp8_scales(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{param: {tensor kind: [E] scales}}`` used on the most recent forward / backward."""
        return {n: dict(q.last_scales) for n, q in self._fp8_quant.items()}

    def fp8_quantizers(self, param: str) -> GroupQuantizers | None:
        return self._fp8_quant.get(param)

    def _project(self, param: ExpertParam, rows: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        quant = self._fp8_quant.get(param.name)
        if quant is not None and quant.recipe.scaling in BLOCK_SCALINGS:
            out = fp8_block_grouped_linear(rows, param.weight_oi(self), offs, quant.recipe)
        else:
            out = fp8_grouped_linear(rows, param.weight_oi(self), offs, quant, self.training)
        tap = self.fp8track_tap
        if tap is not None:
            tap(param.name, rows, offs, out)
        return out

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.fp8_group.kind == "dense":
            return self._dense_forward(*args, **kwargs)
        return self._grouped_forward(*args, **kwargs)

    def _grouped_forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        # transformers.integrations.moe.grouped_mm_experts_forward (transformers 5.25), the GEMMs in FP8.
        device = hidden_states.device
        num_top_k = top_k_index.size(-1)
        num_tokens, hidden_dim = hidden_states.size(0), hidden_states.size(-1)
        sample_weights = top_k_weights.reshape(-1)
        expert_ids = top_k_index.reshape(-1)
        expert_ids_g, perm = torch.sort(expert_ids)
        rows = hidden_states[perm // num_top_k]
        histc_input = expert_ids_g.float() if device.type in ("cpu", "mps") else expert_ids_g.int()
        counts = torch.histc(
            histc_input, bins=self.fp8_group.num_experts, min=0, max=self.fp8_group.num_experts - 1
        )
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        up, down = self.fp8_group.params
        proj = self._project(up, rows, offs)
        if up.bias is not None:
            proj = proj + getattr(self, up.bias)[expert_ids_g]
        proj = self._apply_gate(proj) if getattr(self, "has_gate", True) else self.act_fn(proj)
        proj = self._project(down, proj, offs)
        if down.bias is not None:
            proj = proj + getattr(self, down.bias)[expert_ids_g]
        if getattr(self, "has_post_expert_norm", False):
            proj = self.post_expert_norm(proj)
        weighted = proj * sample_weights[perm].unsqueeze(-1)
        inv_perm = torch.empty_like(perm)
        inv_perm[perm] = torch.arange(perm.size(0), device=device)
        weighted = weighted[inv_perm]
        return weighted.view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden_states.dtype)

    def _dense_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # Llama4TextExperts.forward (transformers 5.25): bmm of every expert over its slice of rows.
        e = self.fp8_group.num_experts
        up, down = self.fp8_group.params
        hidden = hidden_states.shape[-1]
        rows = hidden_states.reshape(-1, hidden)
        offs = equal_offsets(e, rows.shape[0] // e, rows.device)
        gate, upv = self._project(up, rows, offs).chunk(2, dim=-1)
        return self._project(down, upv * self.act_fn(gate), offs)

    def get_extra_state(self) -> dict[str, Any]:
        """Per projection, the delayed scalers' per-expert histories and scales."""
        return {n: q.state_dict() for n, q in self._fp8_quant.items()}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        for n, s in (state or {}).items():
            if n in self._fp8_quant:
                self._fp8_quant[n].load_state_dict(s)


_SUBCLASSES: dict[type, type[nn.Module]] = {}


def _converted_class(cls: type) -> type[nn.Module]:
    """The subclass of ``cls`` and :class:`EmulatedFP8Experts` (one per experts class)."""
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        sub = _SUBCLASSES[cls] = type(f"EmulatedFP8{cls.__name__}", (EmulatedFP8Experts, cls), {})
    return sub


def _converted_instance(cls: type) -> nn.Module:
    """An empty converted ``cls`` for unpickling (:meth:`EmulatedFP8Experts.__reduce_ex__`)."""
    sub = _converted_class(cls)
    return sub.__new__(sub)


def convert_experts(
    module: nn.Module, recipe: Recipe, group: ExpertGroup, fp8_params: Collection[str]
) -> None:
    """Make ``module`` (a fused experts module of ``group``) run ``fp8_params`` in emulated FP8, in
    place (its class becomes a subclass of its own class and :class:`EmulatedFP8Experts`)."""
    module.__class__ = _converted_class(type(module))
    module._init_fp8_experts(recipe, group, fp8_params)  # type: ignore[attr-defined]


def unconverted_reason(group: ExpertGroup, module: nn.Module, recipe: Recipe) -> str | None:
    """Why the emulated backend cannot run ``group`` in FP8 under ``recipe``, or ``None``."""
    if group.kind not in ("fused", "dense"):
        return f"{group.kind} experts are run by their own library, not converted by the emulated backend"
    if recipe.scaling not in GROUPED_SCALINGS:
        return (
            f"recipe {recipe.name!r}: its grouped GEMM is not emulated (expert groups run "
            f"{', '.join(GROUPED_SCALINGS)}); the experts stay in high precision"
        )
    if getattr(module, "_is_expert_parallel", False):
        return "expert-parallel experts (sentinel slots) are not emulated"
    if group.kind == "fused" and not _dispatching_forward(module):
        return (
            f"{type(module).__name__}.forward runs code of its own around the experts implementation "
            "(Ergo: one row per route, a per-expert norm, then the routing weights); the FP8 grouped "
            "forward would replace it and compute another function, so the experts stay in high precision"
        )
    return None


def _dispatching_forward(module: nn.Module) -> bool:
    """Whether ``module``'s forward is the one ``@use_experts_implementation`` installs (it wraps the
    class's own forward, ``functools.wraps``), which the FP8 grouped forward stands in for; a
    subclass overriding it (Ergo's ``ErgoExperts``) does more than the grouped GEMMs."""
    return hasattr(type(module).forward, "__wrapped__")
