"""The one interface every execution backend implements, and the registry the rest asks.

A backend is one file in ``fp8track/execution/backends/`` that defines a :class:`Backend` subclass
and calls :func:`register` on an instance at import; the package imports every such file, so
``apply_fp8``, the monitor's layer plans and the ``ApplyReport`` find it by name
(:func:`get_backend`) or by module (:func:`backend_of`) without testing classes themselves.

What a backend answers:

* which modules it owns (:meth:`Backend.owns`: the GEMM modules it made or recognises, FP8 or its
  own BF16 fallback), and whether one runs FP8 (:meth:`Backend.is_fp8`);
* :meth:`Backend.convert`: put a model's plain ``nn.Linear`` / ``Conv1D`` layers under a recipe,
  returning which run FP8 and which it refused, with the reason;
* per FP8 module: its element formats (:meth:`Backend.format_for`), its scale rule
  (:meth:`Backend.scale_rule`: scaling family, margin, power-of-two rounding) and the scales it
  used, where it exposes them (:meth:`Backend.scale_fns`);
* how the monitor reaches its GEMMs (:meth:`Backend.gemm_suffixes`, :meth:`Backend.hooks_see_gemms`,
  :attr:`Backend.debug_api`) and the forward context it needs (:meth:`Backend.autocast`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from fp8track.errors import ConfigError, invalid_choice
from fp8track.execution.layers import add_gemm_kind, is_hf_conv1d, preview_names
from fp8track.execution.recipes import Recipe
from fp8track.numerics.nvfp4 import NVFP4Recipe

ScaleFn = Callable[[], "torch.Tensor | None"]


@dataclass(frozen=True)
class ScaleRule:
    """How a backend scales one FP8 module's tensors.

    Attributes:
        scaling: ``"delayed"``, ``"current"``, ``"mxfp8"`` or ``"block"``.
        margin: the margin in binades (``scale = M / amax / 2**margin``).
        power_2_scales: round scales down to a power of two (``None``: the scaling's own default).
        nvfp4: the NVFP4 parts on (scaling ``"nvfp4"`` only).
    """

    scaling: str
    margin: int = 0
    power_2_scales: bool | None = None
    nvfp4: NVFP4Recipe | None = None


@dataclass(frozen=True)
class Converted:
    """What :meth:`Backend.convert` did.

    Attributes:
        fp8: qualified names of the layers that now run FP8.
        refused: ``{name: reason}`` of layers the backend kept out of FP8 (TE's shape rules).
        unconverted: ``{name: reason}`` of modules the backend cannot run in FP8 at all (expert
            groups under a recipe it does not emulate for them); ``apply_fp8`` lists and warns.
    """

    fp8: tuple[str, ...]
    refused: dict[str, str] = field(default_factory=dict)
    unconverted: dict[str, str] = field(default_factory=dict)


class Backend:
    """Base of every backend (see the module docstring). Defaults fit a backend whose modules are
    plain module-hook-visible GEMMs with per-tensor current scaling."""

    name: ClassVar[str] = ""
    auto_priority: ClassVar[int | None] = None
    """``backend="auto"`` picks the available backend with the highest priority (``None``: never)."""
    debug_api: ClassVar[bool] = False
    """True when a debug API (TE's nvdlfw_inspect) can hand the monitor what its modules quantise."""
    converts_experts: ClassVar[bool] = False
    """True when :meth:`convert` takes fused mixture-of-experts modules
    (:mod:`fp8track.execution.experts`); other backends get none and ``apply_fp8`` lists them."""

    def available(self) -> bool:
        """Whether the backend can run here."""
        return True

    def owns(self, module: nn.Module) -> bool:
        """``module`` is a GEMM module of this backend (FP8 or this backend's BF16 fallback)."""
        raise NotImplementedError

    def is_fp8(self, module: nn.Module) -> bool:
        """``module`` (owned) quantises in FP8 now."""
        return self.owns(module)

    def recipe_of(self, module: nn.Module) -> Recipe | None:
        """The fp8track :class:`Recipe` the module runs, when the module says (else ``None``)."""
        return None

    def format_for(self, module: nn.Module, tensor: str) -> str:
        """``"e4m3"`` or ``"e5m2"``: the element format of ``tensor`` in FP8 ``module``."""
        recipe = self.recipe_of(module)
        return (recipe or Recipe("current")).formats.for_tensor(tensor).name

    def scale_rule(self, module: nn.Module) -> ScaleRule:
        """The FP8 module's scale rule."""
        recipe = self.recipe_of(module)
        if recipe is None:
            return ScaleRule("current")
        return ScaleRule(recipe.scaling, recipe.margin, nvfp4=recipe.nvfp4)

    def used_scales(self, module: nn.Module) -> dict[str, torch.Tensor] | None:
        """The scales the module used last, on device (no host sync), or ``None`` when transient."""
        return None

    def scale_fns(self, module: nn.Module) -> dict[str, ScaleFn]:
        """For delayed scaling, per tensor kind a function giving the scale in use when the monitor
        observes that tensor (``None`` from a function: derive it with the current rule)."""

        def used(kind: str) -> ScaleFn:
            return lambda: (self.used_scales(module) or {}).get(kind)

        return {k: used(k) for k in ("activation", "weight", "gradient")}

    def convert(
        self, model: nn.Module, recipe: Recipe, names: Sequence[str], keep_bf16: Collection[str]
    ) -> Converted:
        """Convert layers ``names`` of ``model`` (exact ``nn.Linear`` or Hugging Face ``Conv1D``)
        in place; those in ``keep_bf16`` stay out of FP8."""
        raise NotImplementedError

    def autocast(self, recipe: Recipe) -> AbstractContextManager[Any]:
        """Context the FP8 forward pass needs (none by default)."""
        return contextlib.nullcontext()

    def gemm_suffixes(self, module: nn.Module) -> list[str]:
        """Row-name suffix of each GEMM the module runs (``[""]``: one GEMM, the module's own name)."""
        return [""]

    def hooks_see_gemms(self, module: nn.Module) -> bool:
        """A forward hook on the module sees each GEMM's input and weight (one GEMM, first input)."""
        return True

    def __repr__(self) -> str:
        return f"<fp8track backend {self.name!r}>"


def refuse_conv1d(
    backend: str, model: nn.Module, names: Sequence[str], keep_bf16: Collection[str], recipe: Recipe
) -> None:
    """Raise when Hugging Face ``Conv1D`` layers would stay out of FP8 on a backend that converts
    only ``nn.Linear`` (silently leaving them BF16 would misreport the run)."""
    left = [n for n in names if n not in keep_bf16 and is_hf_conv1d(model.get_submodule(n))]
    if left and recipe.quantizes:
        raise ConfigError(
            f"backend {backend!r} converts only nn.Linear, but these transformers Conv1D layers "
            f"(GPT-2 style, weight stored [in, out]) would stay out of FP8: {preview_names(left)}. "
            "Use backend='emulated' (it converts Conv1D), keep them in BF16 on purpose "
            "(bf16_layers=[...their names or a re: term]), or load the model with nn.Linear layers"
        )


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    """Add ``backend`` under ``backend.name`` (a later registration of the name replaces it)."""
    if not backend.name or backend.name == "auto":
        raise ConfigError(f"a backend needs a name other than 'auto', got {backend.name!r}")
    _REGISTRY[backend.name] = backend
    add_gemm_kind(backend.name, backend.owns)  # the monitor and the fallback spec see its modules
    return backend


def registered() -> tuple[str, ...]:
    """Names of the registered backends, in registration order."""
    return tuple(_REGISTRY)


def get_backend(name: str) -> Backend:
    """The backend registered as ``name`` (``"auto"`` resolved first); unknown names are a ConfigError."""
    if name == "auto":
        ranked = [b for b in _REGISTRY.values() if b.auto_priority is not None]
        for b in sorted(ranked, key=lambda b: -(b.auto_priority or 0)):
            if b.available():
                return b
    if name not in _REGISTRY:
        raise invalid_choice("backend", name, ("auto", *_REGISTRY))
    return _REGISTRY[name]


def backend_of(module: nn.Module) -> Backend | None:
    """The backend owning ``module``, or ``None`` for a module no backend converted or recognises."""
    for b in _REGISTRY.values():
        if b.owns(module):
            return b
    return None
