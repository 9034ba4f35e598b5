"""The GEMM layers of a model: the one "is this a linear layer" predicate and the one layer selector.

Every part that looks for linear layers (the monitor's layer choice, the fallback spec,
``apply_fp8``, the backends) asks :func:`is_gemm_layer`, and every part that picks layers by name
(the monitor's ``layers=``, the fallback's ``re:`` and module-name terms) uses :func:`match_layers`.

Classes are recognised by their defining module and name, so neither Transformer Engine nor
Hugging Face ``transformers`` is imported here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import torch
from torch import nn

from fp8track.errors import ConfigError
from fp8track.execution.experts import is_fused_experts

TE_GEMM_CLASSES = ("Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear")
"""Transformer Engine modules that run GEMMs (``transformer_engine.pytorch``), subclasses included."""

HF_CONV1D = ("transformers.pytorch_utils", "Conv1D")
"""Hugging Face's GPT-2 style linear: ``y = x @ W + b`` with ``W`` stored ``[in, out]``."""

GEMM_LAYER_KINDS = (
    "nn.Linear and subclasses (fp8track EmulatedFP8Linear, torchao Float8Linear)",
    "Transformer Engine " + "/".join(TE_GEMM_CLASSES),
    "transformers Conv1D (and fp8track EmulatedFP8Conv1D)",
    "fused mixture-of-experts modules (3-D gate_up_proj/up_proj and down_proj, transformers >= 5)",
)


class InOutWeightGemm(nn.Module):
    """Base of fp8track's own GEMM layers that store their weight ``[in, out]`` as ``Conv1D`` does."""


def _has_base(module: nn.Module, module_prefix: str, names: Sequence[str]) -> bool:
    return any(c.__module__.startswith(module_prefix) and c.__name__ in names for c in type(module).__mro__)


def is_hf_conv1d(module: nn.Module) -> bool:
    """True for ``transformers.pytorch_utils.Conv1D`` (GPT-2's GEMMs) and its subclasses."""
    return _has_base(module, HF_CONV1D[0], (HF_CONV1D[1],))


def is_te_gemm(module: nn.Module) -> bool:
    """True for Transformer Engine's GEMM modules (:data:`TE_GEMM_CLASSES`) and their subclasses."""
    return _has_base(module, "transformer_engine", TE_GEMM_CLASSES)


_BACKEND_GEMMS: dict[str, Callable[[nn.Module], bool]] = {}


def add_gemm_kind(name: str, owns: Callable[[nn.Module], bool]) -> None:
    """Count the modules ``owns`` recognises as GEMM layers too (each registered execution backend's)."""
    _BACKEND_GEMMS[name] = owns


def is_gemm_layer(module: nn.Module) -> bool:
    """THE linear-layer predicate: any module of :data:`GEMM_LAYER_KINDS` or of a registered
    backend (:func:`add_gemm_kind`), FP8 or not."""
    if isinstance(module, (nn.Linear, InOutWeightGemm)) or is_hf_conv1d(module) or is_te_gemm(module):
        return True
    if is_fused_experts(module):
        return True
    return any(owns(module) for owns in _BACKEND_GEMMS.values())


def is_convertible(module: nn.Module) -> bool:
    """A GEMM layer :func:`fp8track.apply_fp8` may convert: exactly ``nn.Linear``, exactly Hugging
    Face ``Conv1D`` (a subclass is someone's own layer, or one already converted), or a fused
    experts module (:mod:`fp8track.execution.experts`; the backend decides whether it can)."""
    cls = type(module)
    return cls is nn.Linear or (cls.__module__, cls.__name__) == HF_CONV1D or is_fused_experts(module)


def gemm_weight(module: nn.Module, weight: object = None) -> torch.Tensor | None:
    """The layer's weight (or ``weight``, a tensor standing for it) in GEMM orientation ``[out, in]``:
    a view, ``None`` if there is no weight tensor.

    ``nn.Linear`` stores that already; ``Conv1D`` stores ``[in, out]`` and gets its transpose, so a
    block-scaled statistic blocks the weight along the reduction dimension ``in`` as the GEMM does.
    """
    if weight is None:
        weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return None
    return weight.t() if isinstance(module, InOutWeightGemm) or is_hf_conv1d(module) else weight


def gemm_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every GEMM layer in registration order (the root is named ``""``).

    The ``out_proj`` Linear of an ``nn.MultiheadAttention`` is left out: the attention calls
    ``F.linear`` on its weight, so the module never runs (see :func:`hidden_gemms`).
    """
    hidden = {f"{n}.{c}" if n else c for n, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)
              for c, _ in m.named_children()}
    return [(name, m) for name, m in model.named_modules() if is_gemm_layer(m) and name not in hidden]


def hidden_gemms(model: nn.Module) -> dict[str, str]:
    """``{module name: reason}`` of modules whose GEMMs no module hook sees and no backend swaps:
    ``nn.MultiheadAttention`` (subclasses included), whose in- and out-projections run through
    ``F.multi_head_attention_forward`` on raw weights. ``fp8track.apply_fp8`` rebuilds exact
    ``nn.MultiheadAttention`` on linears (:mod:`fp8track.execution.attention`)."""
    return {
        n: "nn.MultiheadAttention runs its q/k/v and out projections through F.multi_head_attention_forward "
        "(no module hook sees them); fp8track.apply_fp8 or "
        "fp8track.execution.attention.linearize_attention(model) rebuilds it on nn.Linear projections"
        for n, m in model.named_modules()
        if isinstance(m, nn.MultiheadAttention)
    }


def expert_param_name(model: nn.Module, term: str, names: Sequence[str]) -> bool:
    """Whether ``term`` is ``<experts>.<param>``: one projection of a fused experts module among
    ``names`` (``model.layers.1.mlp.experts.down_proj``)."""
    owner, _, param = term.rpartition(".")
    module = _submodule(model, owner) if owner in names else None
    p = module._parameters.get(param) if module is not None else None
    return module is not None and is_fused_experts(module) and isinstance(p, torch.Tensor) and p.dim() == 3


def _submodule(model: nn.Module, name: str) -> nn.Module | None:
    """``model.get_submodule(name)``, or ``None`` (a canonical name without its holder prefix)."""
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def expert_param_names(model: nn.Module, names: Sequence[str]) -> list[str]:
    """``<experts>.<param>`` of every projection of the fused experts modules among ``names``
    (what ``re:`` terms search besides the layer names)."""
    out = []
    for n in names:
        module = _submodule(model, n)
        if module is not None and is_fused_experts(module):
            out.extend(f"{n}.{p}" for p, t in module._parameters.items()
                       if isinstance(t, torch.Tensor) and t.dim() == 3)
    return out


def preview_names(names: Sequence[str], limit: int = 24) -> str:
    """``names`` joined by commas, cut after ``limit`` with a count of the rest (for error messages)."""
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def compile_selector(term: str, what: str) -> re.Pattern[str] | None:
    """The compiled pattern of an ``re:PATTERN`` term (``None`` for a name); a bad regex is a ConfigError."""
    if not term.startswith("re:"):
        return None
    try:
        return re.compile(term[3:])
    except re.error as exc:
        raise ConfigError(f"{what} regex {term[3:]!r} does not compile: {exc}") from None


def match_layers(
    model: nn.Module, term: str, names: Sequence[str], what: str = "layer selector"
) -> list[str]:
    """The layers of ``names`` (GEMM layer names of ``model``) that one selector ``term`` picks.

    Args:
        term: ``re:PATTERN`` (every name where ``re.search(PATTERN, name)`` matches, fused experts'
            projections ``<experts>.<param>`` included) or the qualified name of a layer, of a fused
            experts projection, or of a module whose GEMM layers are all picked.
        what: how error messages name the setting (``"layer selector"``, ``"bf16_layers term"``).

    Returns:
        the picked names, in the order of ``names``.

    Raises:
        ConfigError: a bad regex, a term matching nothing, or a module that does not exist; the
            message lists the candidates.
    """
    pattern = compile_selector(term, what)
    if pattern is not None:
        hits = [n for n in names if pattern.search(n)]
        params = expert_param_names(model, names)
        hits += [p for p in params if pattern.search(p) and p.rpartition(".")[0] not in hits]
        if not hits:
            raise ConfigError(
                f"{what} {term!r} matches no linear layer; candidates: {preview_names([*names, *params])}"
            )
        return hits
    hits = [n for n in names if n == term or n.startswith(term + ".")]
    if hits:
        return hits
    if expert_param_name(model, term, names):
        return [term]
    try:
        model.get_submodule(term)
    except AttributeError:
        raise ConfigError(
            f"{what} names a missing module {term!r}; linear layers: {preview_names(names)}"
        ) from None
    raise ConfigError(f"{what}: module {term!r} holds no linear layer; linear layers: {preview_names(names)}")
