"""``apply_fp8``: put a model's linear layers into FP8 under a recipe, keeping fallback layers in BF16."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from torch import nn

from fp8track.errors import ConfigError
from fp8track.execution.backends import is_fp8_linear, resolve_backend
from fp8track.execution.backends import te as te_backend
from fp8track.execution.backends import torchao as torchao_backend
from fp8track.execution.backends.emulated import EmulatedFP8Conv1D, EmulatedFP8Layer, EmulatedFP8Linear
from fp8track.execution.fallback import FallbackSpec, linear_names
from fp8track.execution.layers import is_convertible, is_hf_conv1d, preview_names
from fp8track.execution.recipes import Recipe


@dataclass(frozen=True)
class ApplyReport:
    """What :func:`apply_fp8` did.

    Attributes:
        backend: the backend used (``"emulated"``, ``"torchao"`` or ``"te"``; never ``"auto"``).
        recipe: the recipe.
        fp8_layers: qualified names of the linears that run in FP8.
        bf16_layers: ``(name, reason)`` of every linear that stays in BF16.
    """

    backend: str
    recipe: Recipe
    fp8_layers: tuple[str, ...]
    bf16_layers: tuple[tuple[str, str], ...]

    def autocast(self) -> AbstractContextManager[Any]:
        """Context for the forward pass: ``te.autocast`` on the TE backend, a no-op elsewhere."""
        if self.backend == "te":
            return te_backend.autocast(self.recipe)
        return contextlib.nullcontext()

    def to_dict(self) -> dict[str, Any]:
        """Plain data (for run metadata and trackers)."""
        return {
            "backend": self.backend,
            "recipe": self.recipe.to_dict(),
            "fp8_layers": list(self.fp8_layers),
            "bf16_layers": [list(p) for p in self.bf16_layers],
        }


def apply_fp8(
    model: nn.Module,
    recipe: Recipe | str | Mapping[str, Any],
    bf16_layers: FallbackSpec | str | Sequence[str] | None = "none",
    backend: str = "auto",
    ranking: Sequence[str] | Mapping[str, float] | None = None,
    example_inputs: Any = None,
) -> ApplyReport:
    """Convert ``model``'s ``nn.Linear`` layers (and Hugging Face ``Conv1D``) in place to run under ``recipe``.

    Args:
        model: the model (its linears still plain ``nn.Linear`` / ``Conv1D``).
        recipe: a :class:`Recipe`, a recipe string (``"delayed:hybrid:h16:max"``) or a mapping.
        bf16_layers: fallback spec (:mod:`fp8track.execution.fallback`): layers kept in BF16.
        backend: ``"auto"`` (TE when CUDA and TE are usable, else emulated), ``"emulated"``,
            ``"torchao"`` or ``"te"``.
        ranking: layer ranking for ``auto:K`` terms (riskiest first, or name -> score).
        example_inputs: optional inputs to order single linears by execution (no repeated blocks).

    Returns:
        An :class:`ApplyReport`. With the ``bf16`` recipe every linear is listed in
        ``bf16_layers`` (reason ``"recipe bf16"`` unless the spec chose it); the emulated backend
        still swaps them for :class:`EmulatedFP8Linear` so the control runs the same code.
        Hugging Face ``Conv1D`` layers (GPT-2) become :class:`EmulatedFP8Conv1D` on the emulated
        backend; torchao and TE convert only ``nn.Linear``.

    Raises:
        ConfigError: bad recipe, spec, backend, a spec term matching nothing, a model that
            already holds FP8 layers, or ``Conv1D`` layers left in FP8 on the torchao/TE backend.
    """
    recipe = Recipe.parse(recipe)
    spec = FallbackSpec.parse(bf16_layers)
    name = resolve_backend(backend)
    already = [n for n, m in model.named_modules() if is_fp8_linear(m) or isinstance(m, EmulatedFP8Layer)]
    if already:
        raise ConfigError(f"the model already holds FP8 layers ({', '.join(already[:8])}); apply_fp8 once, to a fresh model")
    keep = spec.resolve(model, ranking=ranking, example_inputs=example_inputs)
    names = [n for n in linear_names(model) if is_convertible(model.get_submodule(n))]
    conv1d = [n for n in names if is_hf_conv1d(model.get_submodule(n))]
    linears = [n for n in names if n not in conv1d]

    if name == "emulated":
        fp8 = []
        for n in names:
            if n in keep:
                continue
            layer = model.get_submodule(n)
            wrap = EmulatedFP8Conv1D.from_conv1d if n in conv1d else EmulatedFP8Linear.from_linear
            model.set_submodule(n, wrap(layer, recipe))
            if recipe.quantizes:
                fp8.append(n)
    else:
        left = [n for n in conv1d if n not in keep]
        if left and recipe.quantizes:
            raise ConfigError(
                f"backend {name!r} converts only nn.Linear, but these transformers Conv1D layers (GPT-2 style, "
                f"weight stored [in, out]) would stay out of FP8: {preview_names(left)}. Use backend='emulated' "
                "(it converts Conv1D), keep them in BF16 on purpose (bf16_layers=[...their names or a re: term]), "
                "or load the model with nn.Linear layers"
            )
        if name == "torchao":
            if not recipe.quantizes:
                fp8 = []
            else:
                device = next((p.device.type for p in model.parameters()), "cpu")
                fp8 = torchao_backend.convert(model, recipe, linears, keep, device_type=device)
        else:
            fp8 = te_backend.convert(model, recipe, linears, keep)

    bf16 = [(n, keep.get(n, "recipe bf16")) for n in names if n not in fp8]
    report = ApplyReport(backend=name, recipe=recipe, fp8_layers=tuple(fp8), bf16_layers=tuple(bf16))
    # The monitor reads it to record the recipe and the FP8/BF16 layer sets with the run.
    model.fp8track_report = report
    return report
