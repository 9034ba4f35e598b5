"""Execution backends, found through one registry (:mod:`fp8track.execution.backends.base`).

Every module of this package except ``base`` is a backend: it defines a
:class:`~fp8track.execution.backends.base.Backend` and registers it when imported, and this
package imports them all, so adding a backend is adding one file here. Shipped: ``emulated``
(:mod:`~fp8track.execution.backends.emulated`, any device, TE-faithful numerics), ``torchao``
(:mod:`~fp8track.execution.backends.torchao`), ``te`` (:mod:`~fp8track.execution.backends.te`,
GPU; TE itself is imported lazily). ``auto`` picks the available backend with the highest
``auto_priority``: ``te`` when CUDA is present and Transformer Engine imports, else ``emulated``.

The functions below answer the monitor's questions about a module of any backend by asking the
backend that owns it; none imports torchao or TE.
"""

from __future__ import annotations

import importlib
import pkgutil

import torch
from torch import nn

from fp8track.errors import invalid_choice
from fp8track.execution.backends.base import (
    Backend,
    Converted,
    ScaleRule,
    backend_of,
    get_backend,
    register,
    registered,
)
from fp8track.execution.emulated_linear import EmulatedFP8Conv1D, EmulatedFP8Layer, EmulatedFP8Linear
from fp8track.execution.recipes import Recipe
from fp8track.numerics.formats import TENSOR_KINDS

for _info in pkgutil.iter_modules(__path__):
    if _info.name != "base":
        importlib.import_module(f"{__name__}.{_info.name}")

BACKENDS = ("auto", *registered())

__all__ = [
    "BACKENDS",
    "Backend",
    "Converted",
    "EmulatedFP8Conv1D",
    "EmulatedFP8Layer",
    "EmulatedFP8Linear",
    "ScaleRule",
    "backend_of",
    "fp8_format_for",
    "get_backend",
    "is_fp8_linear",
    "recipe_of",
    "register",
    "registered",
    "resolve_backend",
    "used_scales",
]


def resolve_backend(name: str) -> str:
    """The name of the backend ``name`` selects (``"auto"`` resolved); unknown names are a ConfigError."""
    return get_backend(name).name


def is_fp8_linear(module: nn.Module) -> bool:
    """True for a GEMM layer that quantises in FP8 under any backend.

    The ``bf16`` control's emulated layers and BF16 fallback layers are False.
    """
    b = backend_of(module)
    return b is not None and b.is_fp8(module)


def recipe_of(module: nn.Module) -> Recipe | None:
    """The :class:`Recipe` a layer declares (fp8track's emulated layers), else ``None``."""
    b = backend_of(module)
    return b.recipe_of(module) if b is not None else None


def fp8_format_for(module: nn.Module, tensor: str) -> str:
    """``"e4m3"`` or ``"e5m2"``: the element format ``module`` uses for ``tensor``.

    Args:
        tensor: ``"activation"``, ``"weight"`` or ``"gradient"``.

    Raises:
        ConfigError: for an unknown tensor kind or a module that is not an FP8 linear.
    """
    if tensor not in TENSOR_KINDS:
        raise invalid_choice("tensor kind", tensor, TENSOR_KINDS)
    b = backend_of(module)
    if b is None or not b.is_fp8(module):
        raise invalid_choice(
            "FP8 linear",
            type(module).__name__,
            ["EmulatedFP8Linear", "EmulatedFP8Conv1D", "Float8Linear", "te.Linear"],
        )
    return b.format_for(module, tensor)


def used_scales(module: nn.Module) -> dict[str, torch.Tensor] | None:
    """The scales the backend used last for this layer, on device (no host sync), or ``None``.

    Emulated: :meth:`EmulatedFP8Layer.fp8_scales`. TE: delayed-scaling scales from ``fp8_meta``
    (``None`` for TE's other recipes, whose scales live only inside transient tensors). torchao:
    ``None`` (its scales are transient), so callers fall back to current scaling.
    """
    b = backend_of(module)
    return b.used_scales(module) if b is not None and b.is_fp8(module) else None
