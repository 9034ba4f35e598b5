"""``backend="emulated"``: Transformer Engine's FP8 linear layer emulated on any device (CPU
included), as :class:`~fp8track.execution.emulated_linear.EmulatedFP8Linear` /
:class:`~fp8track.execution.emulated_linear.EmulatedFP8Conv1D` (TE-faithful numerics:
:mod:`fp8track.execution.emulated_linear`, :mod:`fp8track.execution.emulated_gemm`) and, for fused
mixture-of-experts modules, :mod:`fp8track.execution.fp8_experts`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch
from torch import nn

from fp8track.execution.backends.base import Backend, Converted, ScaleFn, ScaleRule, register
from fp8track.execution.emulated_linear import EmulatedFP8Conv1D, EmulatedFP8Layer, EmulatedFP8Linear
from fp8track.execution.experts import expert_group
from fp8track.execution.fp8_experts import EmulatedFP8Experts, convert_experts, unconverted_reason
from fp8track.execution.layers import is_hf_conv1d
from fp8track.execution.recipes import Recipe

# The layer classes are this backend's public names (fp8track.execution.backends.emulated.*).
__all__ = ["EmulatedBackend", "EmulatedFP8Conv1D", "EmulatedFP8Layer", "EmulatedFP8Linear"]


class EmulatedBackend(Backend):
    """``backend="emulated"``: :class:`EmulatedFP8Linear` / :class:`EmulatedFP8Conv1D` on any device.

    Layers of ``names`` outside ``keep_bf16`` are swapped; under the ``bf16`` recipe they run the
    plain forward, so the control goes through the same module code. Fallback layers stay as they are.
    """

    name = "emulated"
    auto_priority = 0
    converts_experts = True

    def owns(self, module: nn.Module) -> bool:
        return isinstance(module, (EmulatedFP8Layer, EmulatedFP8Experts))

    def is_fp8(self, module: nn.Module) -> bool:
        if isinstance(module, EmulatedFP8Experts):
            return bool(module.fp8_params)
        return isinstance(module, EmulatedFP8Layer) and module.fp8_recipe.quantizes

    def recipe_of(self, module: nn.Module) -> Recipe | None:
        return module.fp8_recipe if isinstance(module, (EmulatedFP8Layer, EmulatedFP8Experts)) else None

    def used_scales(self, module: nn.Module) -> dict[str, torch.Tensor] | None:
        if isinstance(module, EmulatedFP8Experts):
            return None  # per expert and projection: fp8_scales() / fp8_quantizers(param)
        return module.fp8_scales() if self.is_fp8(module) else None  # type: ignore[union-attr]

    def scale_fns(self, module: nn.Module) -> dict[str, ScaleFn]:
        fns = super().scale_fns(module)
        scaler = module.delayed_scalers.get("gradient") if isinstance(module, EmulatedFP8Layer) else None
        if scaler is not None:
            # dY is observed before the layer's backward: the scale that backward is about to use.
            fns["gradient"] = lambda: scaler.scale.clone()
        return fns

    def scale_rule(self, module: nn.Module) -> ScaleRule:
        recipe = self.recipe_of(module)
        assert recipe is not None
        return ScaleRule(recipe.scaling, recipe.margin, nvfp4=recipe.nvfp4)

    def convert(
        self, model: nn.Module, recipe: Recipe, names: Sequence[str], keep_bf16: Collection[str]
    ) -> Converted:
        fp8, unconverted = [], {}
        for n in names:
            if n in keep_bf16:
                continue
            layer = model.get_submodule(n)
            group = expert_group(n, layer)
            if group is not None:
                params = [p.name for p in group.params if f"{n}.{p.name}" not in keep_bf16]
                why = unconverted_reason(group, layer, recipe) if recipe.quantizes else None
                if why is not None:
                    unconverted[n] = why
                elif recipe.quantizes and params:
                    convert_experts(layer, recipe, group, params)
                    whole = len(params) == len(group.params)
                    fp8.extend([n] if whole else [f"{n}.{p}" for p in params])
                continue
            wrap = EmulatedFP8Conv1D.from_conv1d if is_hf_conv1d(layer) else EmulatedFP8Linear.from_linear
            model.set_submodule(n, wrap(layer, recipe))
            if recipe.quantizes:
                fp8.append(n)
        return Converted(tuple(fp8), unconverted=unconverted)


register(EmulatedBackend())
