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
from fp8track.execution.backends.emulated import EmulatedFP8Linear
from fp8track.execution.fallback import FallbackSpec, linear_names
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
    """Convert ``model``'s ``nn.Linear`` layers in place to run under ``recipe``.

    Args:
        model: the model (its linears still plain ``nn.Linear``).
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

    Raises:
        ConfigError: bad recipe, spec, backend, a spec term matching nothing, or a model that
            already holds FP8 layers.
    """
    recipe = Recipe.parse(recipe)
    spec = FallbackSpec.parse(bf16_layers)
    name = resolve_backend(backend)
    already = [n for n, m in model.named_modules() if is_fp8_linear(m) or isinstance(m, EmulatedFP8Linear)]
    if already:
        raise ConfigError(f"the model already holds FP8 layers ({', '.join(already[:8])}); apply_fp8 once, to a fresh model")
    keep = spec.resolve(model, ranking=ranking, example_inputs=example_inputs)
    names = [n for n in linear_names(model) if type(model.get_submodule(n)) is nn.Linear]

    if name == "emulated":
        fp8 = []
        for n in names:
            if n in keep:
                continue
            model.set_submodule(n, EmulatedFP8Linear.from_linear(model.get_submodule(n), recipe))
            if recipe.quantizes:
                fp8.append(n)
    elif name == "torchao":
        if not recipe.quantizes:
            fp8 = []
        else:
            device = next((p.device.type for p in model.parameters()), "cpu")
            fp8 = torchao_backend.convert(model, recipe, keep, device_type=device)
    else:
        fp8, refused = te_backend.convert(model, recipe, keep)
        keep = {**keep, **refused}  # layers TE would refuse at the first FP8 forward stay BF16

    bf16 = [(n, keep.get(n, "recipe bf16")) for n in names if n not in fp8]
    report = ApplyReport(backend=name, recipe=recipe, fp8_layers=tuple(fp8), bf16_layers=tuple(bf16))
    # The monitor reads it to record the recipe and the FP8/BF16 layer sets with the run.
    model.fp8track_report = report
    return report
