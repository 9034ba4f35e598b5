"""Transformer Engine backend (GPU only; imported lazily).

Every import of ``transformer_engine`` can raise ``ImportError``, ``RuntimeError`` or ``OSError``
on a machine without CUDA or with a partial install, so nothing here imports it at module load.

Recipe mapping (``transformer_engine/common/recipe/__init__.py``): ``delayed`` ->
``DelayedScaling(margin, fp8_format, amax_history_len, amax_compute_algo)``; ``current`` ->
``Float8CurrentScaling(fp8_format)`` (TE has no margin there: a recipe margin is ignored, with a
warning); ``mxfp8`` -> ``MXFP8BlockScaling(fp8_format)``; ``block`` -> ``Float8BlockScaling(fp8_format)``.
``fp8_input_bf16_gemm`` has no TE recipe (error). ``bf16`` converts layers but never enables FP8.

Conversion (:func:`convert`) replaces ``nn.Linear`` with ``te.Linear`` and moves the original
``Parameter`` objects into it, so tied weights stay tied, ``requires_grad`` is kept and an
optimizer built before conversion still holds the model's parameters. Layers TE would refuse at
the first FP8 forward (:func:`fp8_shape_problem`) and fallback layers become :class:`TEBF16Linear`
(a module-level, picklable ``te.Linear`` subclass running under ``te.autocast(enabled=False)``,
recognised by its class). Nothing is added to the modules: their recipe is TE's own
``fp8_meta["recipe"]``, and TE's debug API names them (fp8track's monitor names unnamed ones after
their qualified names when it binds them). The FP8 layers need an outer autocast:
``ApplyReport.autocast()`` or Lightning's ``TransformerEnginePrecision`` (:func:`lightning_precision`).

Delayed-scaling scales are read from ``fp8_meta["scaling_fwd"|"scaling_bwd"].scale`` (indices
fwd: 0 input, 1 weight; bwd: 0 grad_output, ``transformer_engine/common/common.h``). TE updates
them when the outermost autocast exits (forward) and after backward, so inside a layer's forward /
backward hooks they are the scales in use. ``fp8_meta`` is created lazily in the first forward
(``module/base.py::init_fp8_metadata``), which is why the monitor resolves plans at the first
sampled step.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Collection, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from fp8track.errors import ConfigError
from fp8track.execution.backends.base import Backend, Converted, ScaleRule, refuse_conv1d, register
from fp8track.execution.layers import TE_GEMM_CLASSES, is_hf_conv1d
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
        raise ConfigError(
            f"Transformer Engine is not usable here ({type(exc).__name__}: {exc}); {INSTALL_HINT}"
        ) from None
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


def env_flag(name: str) -> bool:
    """TE's reading of a boolean environment switch: exactly ``"1"`` is on (``recipe/__init__.py``)."""
    return os.getenv(name, "0") == "1"


def current_power_2_scales() -> bool:
    """``Float8CurrentScaling.use_power_2_scales``: ``NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES=1``."""
    return env_flag("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES")


def block_power_2_scales() -> bool:
    """``Float8BlockScaling``: power-of-two scales unless ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1``."""
    return not env_flag("NVTE_FP8_BLOCK_SCALING_FP32_SCALES")


def scale_rule(recipe: Recipe) -> tuple[int, bool | None]:
    """``(margin, power_2_scales)`` TE applies for ``recipe`` when the monitor re-derives a scale.

    Only ``DelayedScaling`` and ``MXFP8BlockScaling`` carry a margin; ``Float8CurrentScaling`` and
    ``Float8BlockScaling`` have none (``common/recipe/__init__.py``) and honour the environment
    switches above (read by TE when it is imported; set them before importing TE).
    """
    if recipe.scaling == "current":
        return 0, current_power_2_scales()
    if recipe.scaling == "block":
        return 0, block_power_2_scales()
    if recipe.scaling == "mxfp8":
        return 0, None  # E8M0 scales are powers of two by construction
    return recipe.margin, None


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
    if recipe.scaling in ("current", "block", "mxfp8") and recipe.margin:
        warnings.warn(
            f"Transformer Engine's {recipe.scaling} scaling has no margin; margin={recipe.margin} is ignored "
            "(the monitor judges these layers with TE's margin 0)",
            stacklevel=2,
        )
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
        return r.MXFP8BlockScaling(fp8_format=fmt)
    if recipe.name == "nvfp4":  # NVFP4BlockScaling (TE >= 2.8, SM 10.x); its three switches
        return r.NVFP4BlockScaling(
            disable_rht=recipe.disable_rht,
            disable_stochastic_rounding=recipe.disable_stochastic_rounding,
            disable_2d_quantization=recipe.disable_2d_quantization,
        )
    return r.Float8BlockScaling(fp8_format=fmt)


# --- shape guard -----------------------------------------------------------------------------------


def fp8_shape_problem(in_features: int, out_features: int, recipe: Recipe) -> str | None:
    """Why TE would refuse this linear's weight in FP8 under ``recipe``, or ``None``.

    Per-tensor and 128-block recipes: ``pytorch/utils.py::assert_dim_for_fp8_exec(inputmat,
    weight)`` (called by ``_Linear.forward`` when FP8 is on) needs the weight's last dim (in) to be
    a multiple of 16 and the product of its other dims (out) a multiple of 8. MXFP8:
    ``MXFP8Quantizer.is_quantizable`` (``pytorch/tensor/mxfp8_tensor.py``) needs both multiples of 32.
    The input's token count is checked by TE at run time (a multiple of 8, 32 for MXFP8) and
    cannot be known at conversion.
    """
    if not recipe.quantizes:
        return None
    if recipe.scaling == "mxfp8":
        need_in, need_out, where = 32, 32, "MXFP8Quantizer.is_quantizable"
    else:
        need_in, need_out, where = 16, 8, "assert_dim_for_fp8_exec"
    if in_features % need_in or out_features % need_out:
        return (
            f"shape {out_features}x{in_features} not FP8-eligible in TE "
            f"(in % {need_in} and out % {need_out} must be 0: {where})"
        )
    return None


# --- conversion ------------------------------------------------------------------------------------

_BF16_CLASS: type | None = None


def _make_bf16_linear_class() -> type:
    te, _ = import_te()

    class TEBF16Linear(te.Linear):
        """A ``te.Linear`` kept out of FP8: its forward runs under ``te.autocast(enabled=False)``."""

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            with te.autocast(enabled=False):
                return super().forward(*args, **kwargs)

    # Pickle finds the class as ``fp8track.execution.backends.te.TEBF16Linear`` (module __getattr__).
    TEBF16Linear.__module__ = __name__
    TEBF16Linear.__qualname__ = "TEBF16Linear"
    return TEBF16Linear


def __getattr__(name: str) -> Any:  # PEP 562: build the TE subclass on first use, importable by name
    global _BF16_CLASS
    if name == "TEBF16Linear":
        if _BF16_CLASS is None:
            _BF16_CLASS = _make_bf16_linear_class()
        return _BF16_CLASS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _adopt(new: nn.Module, attr: str, old: nn.Parameter, adopted: dict[int, nn.Parameter]) -> None:
    """Put ``old`` (or what it became earlier, for tied weights) in place of ``new.<attr>``.

    TE tags its own parameters with attributes (tensor-parallel flags,
    ``set_tensor_model_parallel_attributes``); those are copied onto the adopted parameter so TE
    sees what it expects.
    """
    fresh = getattr(new, attr)
    param = adopted.get(id(old))
    if param is None:
        if old.device == fresh.device and old.dtype == fresh.dtype:
            param = old
        else:
            param = nn.Parameter(
                old.detach().to(device=fresh.device, dtype=fresh.dtype), requires_grad=old.requires_grad
            )
        for k, v in vars(fresh).items():
            if not hasattr(param, k):
                setattr(param, k, v)
        adopted[id(old)] = param
    new.register_parameter(attr, param)


def _te_linear_from(linear: nn.Linear, cls: type, adopted: dict[int, nn.Parameter]) -> nn.Module:
    w = linear.weight
    device = w.device if w.device.type == "cuda" else torch.device("cuda")
    new = cls(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        params_dtype=w.dtype,
        device=device,
    )
    _adopt(new, "weight", w, adopted)
    if linear.bias is not None:
        _adopt(new, "bias", linear.bias, adopted)
    new.train(linear.training)
    return new


def convert(
    model: nn.Module, recipe: Recipe, names: Sequence[str], keep_bf16: Collection[str]
) -> tuple[list[str], dict[str, str]]:
    """Replace the ``nn.Linear`` layers ``names`` with TE modules (``te.Linear`` or :class:`TEBF16Linear`).

    Returns ``(fp8_names, refused)``: the layers that run FP8, and ``{name: reason}`` for layers
    kept in BF16 because TE would refuse their shape (:func:`fp8_shape_problem`).
    """
    to_te_recipe(recipe)  # fail early on recipes TE cannot run
    te, _ = import_te()
    bf16_cls = __getattr__("TEBF16Linear")
    fp8: list[str] = []
    refused: dict[str, str] = {}
    adopted: dict[int, nn.Parameter] = {}
    for name in names:
        linear = model.get_submodule(name)
        bf16 = name in keep_bf16 or not recipe.quantizes
        if not bf16:
            problem = fp8_shape_problem(linear.in_features, linear.out_features, recipe)
            if problem is not None:
                refused[name] = problem
                bf16 = True
        new = _te_linear_from(linear, bf16_cls if bf16 else te.Linear, adopted)
        if not bf16:
            fp8.append(name)
        model.set_submodule(name, new)
    return fp8, refused


def autocast(recipe: Recipe) -> AbstractContextManager[Any]:
    """``te.autocast(enabled=..., recipe=...)`` for ``recipe``."""
    te, _ = import_te()
    return te.autocast(enabled=recipe.quantizes, recipe=to_te_recipe(recipe))


def lightning_precision(recipe: Recipe, weights_dtype: torch.dtype = torch.float32) -> Any:
    """A Lightning ``TransformerEnginePrecision`` plugin running ``recipe`` on already converted layers.

    ``weights_dtype`` defaults to float32 master weights, as the emulated backend keeps them, so
    runs on different backends compare like with like (Lightning's own default is BF16).
    For the ``bf16`` control this returns a plain Lightning precision plugin (``Precision`` for
    float32, ``HalfPrecision`` otherwise): Lightning's TE plugin would substitute ``DelayedScaling()``
    for a missing recipe and enter FP8 autocast, which needs FP8 hardware although every layer
    of the control is a :class:`TEBF16Linear`.
    """
    from lightning.pytorch.plugins import HalfPrecision, Precision, TransformerEnginePrecision

    if not recipe.quantizes:
        if weights_dtype == torch.float32:
            return Precision()
        return HalfPrecision("bf16-true" if weights_dtype == torch.bfloat16 else "16-true")
    return TransformerEnginePrecision(
        weights_dtype=weights_dtype, recipe=to_te_recipe(recipe), replace_layers=False
    )


# --- questions the monitor asks (duck-typed: no TE import) ------------------------------------------


def te_gemm_class(module: nn.Module) -> str | None:
    """The TE GEMM module class ``module`` is or derives from (:data:`TE_GEMM_CLASSES`), else None."""
    for c in type(module).__mro__:
        if c.__module__.startswith("transformer_engine") and c.__name__ in TE_GEMM_CLASSES:
            return c.__name__
    return None


def te_gemm_suffixes(module: nn.Module) -> list[str]:
    """Suffixes TE's debug API appends to the module's name for each of its GEMMs.

    ``Linear``/``LayerNormLinear``: the module name itself; ``LayerNormMLP``: ``.fc1`` and ``.fc2``
    (``layernorm_mlp.py::_get_debug_quantizers``); ``GroupedLinear``: ``.gemm_<i>`` for each of its
    ``num_gemms`` GEMMs (``grouped_linear.py::_get_debug_quantizers``).
    """
    kind = te_gemm_class(module)
    if kind == "LayerNormMLP":
        return [".fc1", ".fc2"]
    if kind == "GroupedLinear":
        return [f".gemm_{i}" for i in range(int(getattr(module, "num_gemms", 0)))]
    return [""] if kind is not None else []


def is_te_module(module: nn.Module) -> bool:
    """A Transformer Engine module (duck-typed: no TE import)."""
    return any(c.__module__.startswith("transformer_engine") for c in type(module).__mro__)


def is_bf16_fallback(module: nn.Module) -> bool:
    """One of fp8track's :class:`TEBF16Linear` fallbacks (by class, so TE is not imported)."""
    return any(c.__name__ == "TEBF16Linear" and c.__module__ == __name__ for c in type(module).__mro__)


def is_te_fp8(module: nn.Module) -> bool:
    """A TE GEMM module that runs FP8 (not one of fp8track's BF16 fallbacks)."""
    return te_gemm_class(module) is not None and not is_bf16_fallback(module)


def is_quantized_tensor(t: Any) -> bool:
    """A TE ``QuantizedTensor`` (``Float8Tensor``, ``MXFP8Tensor``...: FP8 primary weights from
    ``quantized_model_init``), recognised by class name (``pytorch/quantized_tensor.py``)."""
    return any(c.__name__ == "QuantizedTensor" for c in type(t).__mro__)


def te_recipe_scaling(module: nn.Module) -> str | None:
    """fp8track scaling name of the TE recipe the module ran last (``fp8_meta["recipe"]``), if known.

    ``fp8_meta`` exists from construction but holds the recipe only after the first FP8 forward
    (``module/base.py::init_fp8_metadata``).
    """
    meta = getattr(module, "fp8_meta", None)
    te_rec = meta.get("recipe") if isinstance(meta, dict) else None
    if te_rec is None:
        return None
    names = {
        "DelayedScaling": "delayed",
        "Float8CurrentScaling": "current",
        "MXFP8BlockScaling": "mxfp8",
        "Float8BlockScaling": "block",
    }
    return names.get(type(te_rec).__name__)


def te_scale_rule(module: nn.Module, scaling: str) -> tuple[int, bool | None]:
    """``(margin, power_2_scales)`` of the module's TE recipe (see :func:`scale_rule`)."""
    meta = getattr(module, "fp8_meta", None)
    te_rec = meta.get("recipe") if isinstance(meta, dict) else None
    margin = int(getattr(te_rec, "margin", 0)) if scaling == "delayed" else 0
    return scale_rule(
        Recipe(scaling if scaling in ("delayed", "current", "mxfp8", "block") else "current", margin=margin)
    )


def te_format(module: nn.Module, tensor: str) -> str:
    """Element format TE uses for ``tensor`` in ``module`` (from its recipe; TE's default is HYBRID)."""
    meta = getattr(module, "fp8_meta", None)
    meta_recipe = meta.get("recipe") if isinstance(meta, dict) else None
    fmt_name = str(getattr(getattr(meta_recipe, "fp8_format", None), "name", "HYBRID"))
    if fmt_name == "E4M3" or tensor != "gradient":
        return "e4m3"
    return "e5m2"


def te_delayed_scales(module: nn.Module) -> dict[str, torch.Tensor] | None:
    """Delayed-scaling scales from ``fp8_meta`` (copies, on device); ``None`` for other recipes
    and before the first FP8 forward created them."""
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



class TEBackend(Backend):
    """``backend="te"``: Transformer Engine modules, converted by :func:`convert` or built by the user."""

    name = "te"
    auto_priority = 10
    debug_api = True

    def available(self) -> bool:
        return available()

    def owns(self, module: nn.Module) -> bool:
        return te_gemm_class(module) is not None

    def is_fp8(self, module: nn.Module) -> bool:
        return is_te_fp8(module)

    def format_for(self, module: nn.Module, tensor: str) -> str:
        return te_format(module, tensor)

    def scale_rule(self, module: nn.Module) -> ScaleRule:
        # TE's own rule: no margin for current/block scaling, env switches (scale_rule above).
        scaling = te_recipe_scaling(module) or "current"
        margin, power_2 = te_scale_rule(module, scaling)
        return ScaleRule(scaling, margin, power_2)

    def used_scales(self, module: nn.Module) -> dict[str, torch.Tensor] | None:
        return te_delayed_scales(module)

    def convert(
        self, model: nn.Module, recipe: Recipe, names: Sequence[str], keep_bf16: Collection[str]
    ) -> Converted:
        refuse_conv1d(self.name, model, names, keep_bf16, recipe)
        linears = [n for n in names if not is_hf_conv1d(model.get_submodule(n))]
        fp8, refused = convert(model, recipe, linears, keep_bf16)
        return Converted(tuple(fp8), refused)

    def autocast(self, recipe: Recipe) -> AbstractContextManager[Any]:
        return autocast(recipe)

    def gemm_suffixes(self, module: nn.Module) -> list[str]:
        return te_gemm_suffixes(module)

    def hooks_see_gemms(self, module: nn.Module) -> bool:
        # LayerNormLinear's ln_out, LayerNormMLP's fc2 input, GroupedLinear's weights: only TE's
        # debug API sees what those modules quantise.
        return te_gemm_class(module) == "Linear"


register(TEBackend())
