"""Transformer Engine backend (GPU only; imported lazily).

Every import of ``transformer_engine`` can raise ``ImportError``, ``RuntimeError`` or ``OSError``
on a machine without CUDA or with a partial install, so nothing here imports it at module load.

Recipe mapping: ``delayed`` -> ``DelayedScaling(margin, fp8_format, amax_history_len,
amax_compute_algo)``; ``current`` -> ``Float8CurrentScaling(fp8_format)``; ``mxfp8`` ->
``MXFP8BlockScaling(margin, fp8_format)``; ``block`` -> ``Float8BlockScaling(fp8_format)``.
``fp8_input_bf16_gemm`` has no TE recipe (error). ``bf16`` converts layers but never enables FP8.

Conversion replaces ``nn.Linear`` with ``te.Linear`` (weights copied; parameter identity is lost,
so build optimizers afterwards). Fallback layers become ``te.Linear`` subclasses that run under
``te.autocast(enabled=False)``, so an outer FP8 autocast leaves them in BF16. The FP8 layers need
an outer autocast: ``ApplyReport.autocast()`` or Lightning's ``TransformerEnginePrecision``
(:func:`lightning_precision`).

Delayed-scaling scales are read from ``fp8_meta["scaling_fwd"|"scaling_bwd"].scale`` (indices
fwd: 0 input, 1 weight; bwd: 0 grad_output). TE updates them when the outermost autocast exits
(forward) and after backward, so inside a layer's forward / backward hooks they are the scales in
use; after the step they are the next step's scales.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from fp8track.errors import ConfigError
from fp8track.execution.recipes import Recipe

INSTALL_HINT = (
    "Transformer Engine needs a CUDA machine: `pip install --no-build-isolation transformer_engine[pytorch]` "
    "or an NGC PyTorch container"
)
_IMPORT_ERRORS = (ImportError, RuntimeError, OSError)


def import_te() -> tuple[Any, Any]:
    """``(transformer_engine.pytorch, transformer_engine.common.recipe)``; raises :class:`ConfigError`."""
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.common import recipe as te_recipe
    except _IMPORT_ERRORS as exc:
        raise ConfigError(f"Transformer Engine is not usable here ({type(exc).__name__}: {exc}); {INSTALL_HINT}") from None
    return te, te_recipe


def available() -> bool:
    """True when CUDA is present and Transformer Engine imports."""
    if not torch.cuda.is_available():
        return False
    try:
        import_te()
    except ConfigError:
        return False
    return True


def to_te_recipe(recipe: Recipe) -> Any:
    """The Transformer Engine recipe object for ``recipe`` (``None`` for ``bf16``)."""
    if recipe.name == "bf16":
        return None
    if recipe.name == "fp8_input_bf16_gemm" or recipe.gemm == "bf16":
        raise ConfigError(
            "Transformer Engine has no 'FP8 input, BF16 GEMM' recipe; use backend 'emulated' (or 'torchao', "
            "which emulates with a float32 GEMM), or TE's debug feature FakeQuant"
        )
    if recipe.variant != "tensorwise":
        raise ConfigError(f"variant {recipe.variant!r} exists only on the torchao backend")
    _, r = import_te()
    fmt = r.Format.HYBRID if recipe.fp8_format == "hybrid" else r.Format.E4M3
    if recipe.scaling == "delayed":
        return r.DelayedScaling(
            margin=recipe.margin,
            fp8_format=fmt,
            amax_history_len=recipe.amax_history_len,
            amax_compute_algo=recipe.amax_compute_algo,
        )
    if recipe.scaling == "current":
        return r.Float8CurrentScaling(fp8_format=fmt)
    if recipe.scaling == "mxfp8":
        return r.MXFP8BlockScaling(margin=recipe.margin, fp8_format=fmt)
    return r.Float8BlockScaling(fp8_format=fmt)


@functools.cache
def _bf16_linear_class() -> type:
    te, _ = import_te()

    class TEBF16Linear(te.Linear):
        """A ``te.Linear`` kept out of FP8: its forward runs under ``te.autocast(enabled=False)``."""

        fp8track_bf16 = True

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            with te.autocast(enabled=False):
                return super().forward(*args, **kwargs)

    return TEBF16Linear


def _te_linear_from(linear: nn.Linear, cls: type) -> nn.Module:
    w = linear.weight
    device = w.device if w.device.type == "cuda" else torch.device("cuda")
    new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, params_dtype=w.dtype, device=device)
    with torch.no_grad():
        new.weight.copy_(w)
        if linear.bias is not None:
            new.bias.copy_(linear.bias)
    new.train(linear.training)
    return new


def convert(model: nn.Module, recipe: Recipe, names: Sequence[str], keep_bf16: Collection[str]) -> list[str]:
    """Replace the ``nn.Linear`` layers ``names`` with TE modules (FP8 ones carry ``fp8_recipe``);
    returns the FP8 names."""
    to_te_recipe(recipe)  # fail early on recipes TE cannot run
    te, _ = import_te()
    fp8: list[str] = []
    for name in names:
        linear = model.get_submodule(name)
        bf16 = name in keep_bf16 or not recipe.quantizes
        new = _te_linear_from(linear, _bf16_linear_class() if bf16 else te.Linear)
        if not bf16:
            new.fp8_recipe = recipe
            fp8.append(name)
        model.set_submodule(name, new)
    return fp8


def autocast(recipe: Recipe) -> AbstractContextManager[Any]:
    """``te.autocast(enabled=..., recipe=...)`` for ``recipe``."""
    te, _ = import_te()
    return te.autocast(enabled=recipe.quantizes, recipe=to_te_recipe(recipe))


def lightning_precision(recipe: Recipe, weights_dtype: torch.dtype = torch.bfloat16) -> Any:
    """A Lightning ``TransformerEnginePrecision`` plugin running ``recipe`` on already converted layers."""
    from lightning.pytorch.plugins import TransformerEnginePrecision

    return TransformerEnginePrecision(weights_dtype=weights_dtype, recipe=to_te_recipe(recipe), replace_layers=False)


def is_te_module(module: nn.Module) -> bool:
    """A Transformer Engine module with FP8 state (duck-typed: no TE import)."""
    return any(c.__module__.startswith("transformer_engine") for c in type(module).__mro__)


def is_te_fp8(module: nn.Module) -> bool:
    """A TE linear-like module that runs FP8 (not one of our BF16 fallbacks)."""
    return is_te_module(module) and hasattr(module, "fp8_meta") and not getattr(module, "fp8track_bf16", False)


def te_format(module: nn.Module, tensor: str) -> str:
    """Element format TE uses for ``tensor`` in ``module`` (from its recipe)."""
    recipe = getattr(module, "fp8_recipe", None)
    if isinstance(recipe, Recipe):
        return recipe.formats.for_tensor(tensor).name
    meta_recipe = getattr(module, "fp8_meta", {}).get("recipe")
    fmt_name = str(getattr(getattr(meta_recipe, "fp8_format", None), "name", "HYBRID"))
    if fmt_name == "E4M3" or tensor != "gradient":
        return "e4m3"
    return "e5m2"


def te_delayed_scales(module: nn.Module) -> dict[str, torch.Tensor] | None:
    """Delayed-scaling scales from ``fp8_meta`` (copies, on device); ``None`` for other recipes."""
    meta = getattr(module, "fp8_meta", None)
    if not isinstance(meta, dict):
        return None
    fwd, bwd = meta.get("scaling_fwd"), meta.get("scaling_bwd")
    if fwd is None or not hasattr(fwd, "amax_history") or not hasattr(fwd, "scale"):
        return None
    out = {"activation": fwd.scale[0].detach().clone(), "weight": fwd.scale[1].detach().clone()}
    if bwd is not None and hasattr(bwd, "scale"):
        out["gradient"] = bwd.scale[0].detach().clone()
    return out
