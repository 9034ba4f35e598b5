"""Execution backends and the questions the monitor asks of any FP8 layer.

Backends: ``emulated`` (:mod:`fp8track.execution.backends.emulated`, any device, TE-faithful numerics),
``torchao`` (:mod:`fp8track.execution.backends.torchao`), ``te`` (:mod:`fp8track.execution.backends.te`, GPU).
``auto`` picks ``te`` when CUDA is present and Transformer Engine imports, else ``emulated``.

The three functions below work on a module from any backend without importing torchao or TE.
"""

from __future__ import annotations

import torch
from torch import nn

from fp8track.errors import invalid_choice
from fp8track.execution.backends import te as _te
from fp8track.execution.backends import torchao as _torchao
from fp8track.execution.backends.emulated import EmulatedFP8Conv1D, EmulatedFP8Layer, EmulatedFP8Linear
from fp8track.execution.recipes import Recipe
from fp8track.numerics.formats import TENSOR_KINDS

BACKENDS = ("auto", "emulated", "torchao", "te")

__all__ = [
    "BACKENDS",
    "EmulatedFP8Conv1D",
    "EmulatedFP8Layer",
    "EmulatedFP8Linear",
    "resolve_backend",
    "is_fp8_linear",
    "fp8_format_for",
    "used_scales",
    "recipe_of",
]


def resolve_backend(name: str) -> str:
    """``name`` itself, or for ``"auto"``: ``"te"`` if CUDA and TE are usable, else ``"emulated"``."""
    if name not in BACKENDS:
        raise invalid_choice("backend", name, BACKENDS)
    if name == "auto":
        return "te" if _te.available() else "emulated"
    return name


def is_fp8_linear(module: nn.Module) -> bool:
    """True for a linear layer that quantises in FP8 under any backend.

    The ``bf16`` control's emulated layers and BF16 fallback layers are False.
    """
    if isinstance(module, EmulatedFP8Layer):
        return module.fp8_recipe.quantizes
    return _torchao.is_torchao_fp8(module) or _te.is_te_fp8(module)


def recipe_of(module: nn.Module) -> Recipe | None:
    """The :class:`Recipe` a layer converted by :func:`fp8track.apply_fp8` runs (else ``None``)."""
    recipe = getattr(module, "fp8_recipe", None)
    return recipe if isinstance(recipe, Recipe) else None


def fp8_format_for(module: nn.Module, tensor: str) -> str:
    """``"e4m3"`` or ``"e5m2"``: the element format ``module`` uses for ``tensor``.

    Args:
        tensor: ``"activation"``, ``"weight"`` or ``"gradient"``.

    Raises:
        ConfigError: for an unknown tensor kind or a module that is not an FP8 linear.
    """
    if tensor not in TENSOR_KINDS:
        raise invalid_choice("tensor kind", tensor, TENSOR_KINDS)
    if _torchao.is_torchao_fp8(module):
        return _torchao.torchao_format(module, tensor)
    if _te.is_te_fp8(module):
        return _te.te_format(module, tensor)
    recipe = recipe_of(module)
    if recipe is None or not is_fp8_linear(module):
        raise invalid_choice("FP8 linear", type(module).__name__, ["EmulatedFP8Linear", "EmulatedFP8Conv1D", "Float8Linear", "te.Linear"])
    return recipe.formats.for_tensor(tensor).name


def used_scales(module: nn.Module) -> dict[str, torch.Tensor] | None:
    """The scales the backend used last for this layer, on device (no host sync), or ``None``.

    Emulated: :meth:`EmulatedFP8Layer.fp8_scales`. TE: delayed-scaling scales from ``fp8_meta``
    (``None`` for TE's other recipes, whose scales live only inside transient tensors). torchao:
    ``None`` (its scales are transient), so callers fall back to current scaling.
    """
    if isinstance(module, EmulatedFP8Layer):
        return module.fp8_scales() if module.fp8_recipe.quantizes else None
    if _te.is_te_fp8(module):
        return _te.te_delayed_scales(module)
    return None
