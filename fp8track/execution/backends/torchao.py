"""torchao float8 backend: ``convert_to_float8_training`` with the fallback spec as its filter.

Recipe mapping (torchao >= 0.10 offers dynamic scaling only):

=========================  =============================================================
fp8track recipe            torchao ``Float8LinearConfig``
=========================  =============================================================
``current`` (tensorwise)   ``from_recipe_name("tensorwise")``; with ``fp8_format="e4m3"``
                           the gradient casts to e4m3 instead of e5m2
``current`` rowwise        ``from_recipe_name("rowwise")`` (e4m3 everywhere)
``current`` rowwise_w_gw   ``from_recipe_name("rowwise_with_gw_hp")``
``fp8_input_bf16_gemm``    tensorwise with ``emulate=True``: FP8 operands, dequantised,
                           high-precision (float32) GEMM
``delayed``                error: torchao removed delayed scaling (pytorch/ao#1680, v0.10)
``mxfp8``, ``block``       error: not part of torchao's float8 training API
``bf16``                   no conversion
=========================  =============================================================

On CPU (or any device without an FP8 GEMM) ``emulate=True`` is set with ``dataclasses.replace``
(the config is frozen). torchao has no margin; a non-zero margin is an error.

Fused mixture-of-experts modules (:mod:`fp8track.execution.experts`) go through torchao's MoE
training (``torchao.prototype.moe_training``: ``quantize_`` with ``Float8TrainingOpConfig``, its
weight wrapper intercepting the grouped GEMMs; rowwise FP8, per-token activation and per-expert
per-column weight scales), filtered to the experts modules as torchtitan does. It runs the
``rowwise`` recipe on CUDA only (its casts are Triton kernels); any other recipe or device lists
the experts as unconverted, with the reason.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch import nn

from fp8track.errors import ConfigError
from fp8track.execution.backends.base import Backend, Converted, ScaleRule, refuse_conv1d, register
from fp8track.execution.experts import expert_group
from fp8track.execution.layers import is_hf_conv1d
from fp8track.execution.recipes import Recipe
from fp8track.numerics.scaling import BLOCK_SCALINGS

INSTALL_HINT = "install it with `pip install fp8track[torchao]` (torchao>=0.18)"


def _import_torchao() -> Any:
    try:
        import torchao.float8 as float8
    except ImportError as exc:
        raise ConfigError(f"backend 'torchao' needs torchao: {exc}; {INSTALL_HINT}") from None
    return float8


def torchao_config(recipe: Recipe, device_type: str = "cpu") -> Any:
    """The ``Float8LinearConfig`` for ``recipe`` (see the module table); raises :class:`ConfigError`."""
    if recipe.scaling == "delayed":
        raise ConfigError(
            "torchao does not offer delayed scaling (removed in torchao 0.10, pytorch/ao#1680); "
            "use recipe 'current', or backend 'emulated' or 'te' for delayed scaling"
        )
    if recipe.scaling in BLOCK_SCALINGS or recipe.name == "nvfp4":
        raise ConfigError(
            f"recipe {recipe.name!r} is not part of torchao's float8 training API (tensorwise/rowwise only); "
            "use backend 'emulated' or 'te'"
        )
    if recipe.margin:
        raise ConfigError(f"torchao has no scaling margin; got margin={recipe.margin}, use 0")
    float8 = _import_torchao()
    from torchao.float8.config import CastConfig

    cfg = float8.Float8LinearConfig.from_recipe_name(recipe.variant)
    if recipe.variant == "tensorwise" and recipe.fp8_format == "e4m3":
        e4m3 = CastConfig(target_dtype=torch.float8_e4m3fn)
        cfg = dataclasses.replace(
            cfg, cast_config_grad_output=e4m3, cast_config_grad_output_for_grad_weight=e4m3
        )
    if device_type != "cuda" or recipe.name == "fp8_input_bf16_gemm":
        cfg = dataclasses.replace(cfg, emulate=True)
    return cfg


def convert(
    model: nn.Module,
    recipe: Recipe,
    names: Collection[str],
    keep_bf16: Collection[str],
    device_type: str = "cpu",
) -> list[str]:
    """Convert the ``nn.Linear`` layers ``names`` not in ``keep_bf16`` to torchao's ``Float8Linear``.

    Returns the converted layers' qualified names. Parameters keep their identity.
    """
    cfg = torchao_config(recipe, device_type)
    float8 = _import_torchao()
    converted: list[str] = []
    wanted = set(names)

    def keep_fp8(module: nn.Module, fqn: str) -> bool:
        ok = fqn in wanted and fqn not in keep_bf16
        if ok:
            converted.append(fqn)
        return ok

    float8.convert_to_float8_training(model, module_filter_fn=keep_fp8, config=cfg)
    return converted


def is_torchao_fp8(module: nn.Module) -> bool:
    """True for torchao's ``Float8Linear`` (checked by class name, so torchao is not imported)."""
    return type(module).__name__ == "Float8Linear" and type(module).__module__.startswith("torchao.")


def torchao_format(module: nn.Module, tensor: str) -> str:
    """Element format of ``tensor`` in a ``Float8Linear``, read from its config."""
    cfg = module.config
    cast = {
        "activation": cfg.cast_config_input,
        "weight": cfg.cast_config_weight,
        "gradient": cfg.cast_config_grad_output,
    }[tensor]
    return "e5m2" if "e5m2" in str(cast.target_dtype) else "e4m3"


def experts_reason(recipe: Recipe, device_type: str) -> str | None:
    """Why torchao's MoE training cannot run fused experts under ``recipe`` here, or ``None``."""
    if recipe.variant != "rowwise":
        return (
            f"torchao's MoE training runs FP8 grouped GEMMs with rowwise scales only (recipe 'rowwise'), "
            f"not {recipe.variant!r}; the experts stay in high precision (or use backend='emulated')"
        )
    if device_type != "cuda":
        return "torchao's FP8 MoE training needs CUDA (its rowwise casts are Triton kernels); " \
            "the experts stay in high precision (or use backend='emulated')"
    return None


def convert_experts(model: nn.Module, names: Collection[str]) -> list[str]:
    """Wrap the weights of the experts modules ``names`` for torchao's FP8 MoE training."""
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.quantization import quantize_

    wanted = set(names)
    quantize_(model, Float8TrainingOpConfig(), filter_fn=lambda module, fqn: fqn in wanted)
    return [n for n in names if n in wanted]


class TorchaoBackend(Backend):
    """``backend="torchao"``: ``Float8Linear`` (dynamic scaling only; see the module table) and
    fused experts through torchao's MoE training (see the module docstring)."""

    name = "torchao"
    converts_experts = True

    def owns(self, module: nn.Module) -> bool:
        return is_torchao_fp8(module)

    def format_for(self, module: nn.Module, tensor: str) -> str:
        return torchao_format(module, tensor)

    def scale_rule(self, module: nn.Module) -> ScaleRule:
        # torchao scales dynamically with no margin; rowwise variants are judged tensor-wise by the
        # monitor (a documented approximation).
        return ScaleRule("current", 0)

    def convert(
        self, model: nn.Module, recipe: Recipe, names: Sequence[str], keep_bf16: Collection[str]
    ) -> Converted:
        refuse_conv1d(self.name, model, names, keep_bf16, recipe)
        if not recipe.quantizes:
            return Converted(())
        device = next((p.device.type for p in model.parameters()), "cpu")
        groups = [n for n in names if expert_group(n, model.get_submodule(n)) is not None]
        experts = [n for n in groups if n not in keep_bf16]
        why = experts_reason(recipe, device) if experts else None
        split = {n for n in experts if any(k.startswith(n + ".") for k in keep_bf16)}
        unconverted = {n: why for n in experts} if why else {
            n: "torchao's MoE training wraps every weight of an experts module: one projection cannot "
            "stay in BF16 (keep the whole group, or use backend='emulated')" for n in split
        }
        fp8_experts = [] if why else convert_experts(model, [n for n in experts if n not in split])
        linears = [n for n in names if n not in groups and not is_hf_conv1d(model.get_submodule(n))]
        # torchao's hardware rule (torchao/float8/float8_linear_utils.py, _auto_filter_for_recipe):
        # float8 GEMMs need both dims divisible by 16; applied on CPU too, so emulation refuses
        # what a GPU run would.
        refused = {
            n: f"shape {m.in_features}x{m.out_features}: torchao's float8 GEMM needs dims divisible by 16"
            for n in linears
            if n not in keep_bf16
            and ((m := model.get_submodule(n)).in_features % 16 or m.out_features % 16)
        }
        keep = set(keep_bf16) | set(refused)
        fp8 = convert(model, recipe, linears, keep, device_type=device)
        return Converted((*fp8, *fp8_experts), refused, unconverted)


register(TorchaoBackend())
