"""``apply_fp8``: put a model's linear layers into FP8 under a recipe, keeping fallback layers in BF16."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from torch import nn

from fp8track.errors import ConfigError
from fp8track.execution.attention import linearize_attention
from fp8track.execution.backends import Backend, Converted, backend_of, get_backend
from fp8track.execution.blocks import linear_names
from fp8track.execution.experts import ROUTER_REASON, MoEMap, find_moe, unrecognised_experts
from fp8track.execution.fallback import FallbackSpec
from fp8track.execution.layers import is_convertible, preview_names
from fp8track.execution.recipes import Recipe


@dataclass(frozen=True)
class ApplyReport:
    """What :func:`apply_fp8` did.

    Attributes:
        backend: the backend used (``"emulated"``, ``"torchao"`` or ``"te"``; never ``"auto"``).
        recipe: the recipe.
        fp8_layers: qualified names of the linears that run in FP8.
        bf16_layers: ``(name, reason)`` of every linear that stays in BF16.
        unconverted: ``(module name, reason)`` of every module that runs GEMMs the backend could
            not convert (subclasses of ``nn.Linear`` such as someone's own layer, an
            ``nn.MultiheadAttention`` subclass); they run in high precision and
            :func:`apply_fp8` warned about them.
        notes: what the fallback spec's block and head terms kept and why
            (:meth:`~fp8track.execution.fallback.FallbackSpec.explain`), and attention modules rebuilt.
    """

    backend: str
    recipe: Recipe
    fp8_layers: tuple[str, ...]
    bf16_layers: tuple[tuple[str, str], ...]
    unconverted: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = ()

    def autocast(self) -> AbstractContextManager[Any]:
        """Context for the forward pass the backend needs (``te.autocast`` on TE, a no-op elsewhere)."""
        return get_backend(self.backend).autocast(self.recipe)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (for run metadata and trackers)."""
        return {
            "backend": self.backend,
            "recipe": self.recipe.to_dict(),
            "fp8_layers": list(self.fp8_layers),
            "bf16_layers": [list(p) for p in self.bf16_layers],
            "unconverted": [list(p) for p in self.unconverted],
            "notes": list(self.notes),
        }


_REPORTS: weakref.WeakKeyDictionary[nn.Module, ApplyReport] = weakref.WeakKeyDictionary()


def applied_report(model: nn.Module) -> ApplyReport | None:
    """The report of :func:`apply_fp8` on ``model`` or one of its submodules, else ``None``.

    For callers that were not handed the report (pass it explicitly where you can:
    ``fp8track.Monitor(..., apply_report=report)``, ``FP8Monitor(apply_report=report)``). Reports
    are remembered beside the model in a weak table: nothing is stored on the model itself.
    """
    for m in model.modules():
        report = _REPORTS.get(m)
        if report is not None:
            return report
    return None


def apply_fp8(
    model: nn.Module,
    recipe: Recipe | str | Mapping[str, Any],
    bf16_layers: FallbackSpec | str | Sequence[str] | None = "none",
    backend: str = "auto",
    ranking: Sequence[str] | Mapping[str, float] | None = None,
    example_inputs: Any = None,
    fp8_routers: bool = False,
) -> ApplyReport:
    """Convert ``model``'s ``nn.Linear`` layers (and Hugging Face ``Conv1D``, and fused
    mixture-of-experts modules) in place to run under ``recipe``.

    ``nn.MultiheadAttention`` modules are first rebuilt as
    :class:`~fp8track.execution.attention.LinearMultiheadAttention` (the same function with its
    four projections as ``nn.Linear`` modules), so every backend converts those projections and
    the monitor sees them; they are named ``<attention>.q_proj`` / ``k_proj`` / ``v_proj`` /
    ``out_proj`` in the report and in fallback specs.

    Mixture-of-experts models (:mod:`fp8track.execution.experts`): fused expert modules run FP8
    grouped GEMMs with one quantizer per expert on the emulated backend
    (:mod:`fp8track.execution.fp8_experts`); a backend or recipe that cannot run them lists them in
    ``ApplyReport.unconverted`` with the reason and warns. Routers (and Qwen2-MoE's
    ``shared_expert_gate``) stay in high precision, as in every reference implementation, unless
    ``fp8_routers`` is True (a router that is no ``nn.Linear`` is then listed as unconverted).
    ``<experts>.<param>`` in ``bf16_layers`` keeps one projection.

    Args:
        model: the model (its linears still plain ``nn.Linear`` / ``Conv1D``).
        recipe: a :class:`Recipe`, a recipe string (``"delayed:hybrid:h16:max"``) or a mapping.
        bf16_layers: fallback spec (:mod:`fp8track.execution.fallback`): layers kept in BF16.
        backend: ``"auto"`` (TE when CUDA and TE are usable, else emulated) or a registered
            backend's name (:func:`fp8track.execution.backends.registered`: ``"emulated"``,
            ``"torchao"``, ``"te"``).
        ranking: layer ranking for ``auto:K`` terms (riskiest first, or name -> score).
        example_inputs: optional inputs to order single linears by execution (no repeated blocks).
        fp8_routers: convert router linears too (default: kept in high precision).

    Returns:
        An :class:`ApplyReport` (hand it to the monitor: ``fp8track.Monitor(..., apply_report=)``).
        With the ``bf16`` recipe every linear is listed in ``bf16_layers`` (reason
        ``"recipe bf16"`` unless the spec chose it); the emulated backend still swaps them for
        :class:`EmulatedFP8Linear` so the control runs the same code. Hugging Face ``Conv1D``
        layers (GPT-2) become :class:`EmulatedFP8Conv1D` on the emulated backend; torchao and TE
        convert only ``nn.Linear``.

    Raises:
        ConfigError: bad recipe, spec, backend, a spec term matching nothing, a model that
            already holds FP8 layers, or ``Conv1D`` layers left in FP8 on the torchao/TE backend.
            The model is left as it was.
    """
    recipe = Recipe.parse(recipe)
    spec = FallbackSpec.parse(bf16_layers)
    chosen = get_backend(backend)
    _refuse_converted(model)
    rebuilt, refused_attention = linearize_attention(model)
    try:
        keep, notes = spec.resolve_with_notes(model, ranking=ranking, example_inputs=example_inputs)
        plan = _plan(model, chosen, keep, fp8_routers)
        converted = chosen.convert(model, recipe, plan.names, keep)
    except BaseException:
        for name, original in rebuilt:
            model.set_submodule(name, original)
        raise
    if rebuilt:
        notes = (*notes, "nn.MultiheadAttention rebuilt on q_proj/k_proj/v_proj/out_proj linears: "
                 + ", ".join(n for n, _ in rebuilt))
    report = _report(model, chosen.name, recipe, plan, converted, keep, notes, refused_attention)
    _REPORTS[model] = report
    return report


def _report(
    model: nn.Module,
    backend: str,
    recipe: Recipe,
    plan: _Plan,
    converted: Converted,
    keep: Mapping[str, str],
    notes: Sequence[str],
    refused_attention: Mapping[str, str],
) -> ApplyReport:
    """The report of a conversion; warns about the modules left unconverted (under an FP8 recipe)."""
    keep = {**keep, **converted.refused}  # layers the backend would refuse at run time stay BF16
    unconverted = {**dict(refused_attention), **plan.unconverted, **converted.unconverted}
    unconverted.update(_left_out(model, plan, unconverted, list(refused_attention)))
    unconverted.update(unrecognised_experts(model, plan.moe))  # DBRX, JetMoE: listed, never skipped silently
    if unconverted and recipe.quantizes:
        _warn_unconverted(unconverted)
    return ApplyReport(
        backend=backend,
        recipe=recipe,
        fp8_layers=converted.fp8,
        bf16_layers=_bf16_layers(plan, keep, converted.fp8, unconverted),
        unconverted=tuple(unconverted.items()),
        notes=tuple(notes),
    )


def _refuse_converted(model: nn.Module) -> None:
    already = [n for n, m in model.named_modules() if backend_of(m) is not None]
    if already:
        raise ConfigError(
            f"the model already holds FP8 layers or FP8-backend modules ({preview_names(already, 8)}); "
            "apply_fp8 once, to a fresh model"
        )


@dataclass(frozen=True)
class _Plan:
    """What :func:`apply_fp8` hands the backend: ``gemms`` every GEMM layer, ``names`` those to
    convert, ``unconverted`` expert groups the backend cannot run, ``routers`` the router GEMMs
    (kept in high precision unless ``fp8_routers``), ``moe`` the model's MoE structure."""

    gemms: tuple[str, ...]
    names: tuple[str, ...]
    unconverted: dict[str, str]
    routers: frozenset[str]
    fp8_routers: bool
    moe: MoEMap


def _plan(model: nn.Module, backend: Backend, keep: dict[str, str], fp8_routers: bool) -> _Plan:
    """The conversion plan; routers go into ``keep`` (unless ``fp8_routers``)."""
    gemms = linear_names(model)
    names = [n for n in gemms if is_convertible(model.get_submodule(n))]
    moe = find_moe(model)
    routers = frozenset(moe.router_gemms())
    if not fp8_routers:
        for r in routers & set(names):
            keep.setdefault(r, ROUTER_REASON)
    unconverted = {} if backend.converts_experts else {
        g.fqn: f"the {backend.name} backend does not convert fused experts ({g.kind}); they run in "
        "high precision (use backend='emulated', or TE GroupedLinear / torchao MoE training)"
        for g in moe.groups if g.fqn in names
    }
    names = [n for n in names if n not in unconverted]
    return _Plan(tuple(gemms), tuple(names), unconverted, routers, fp8_routers, moe)


def _left_out(
    model: nn.Module, plan: _Plan, unconverted: Mapping[str, str], attention: Sequence[str]
) -> dict[str, str]:
    """``{name: reason}`` of the GEMMs no backend converts: ``nn.Linear`` subclasses (a router
    subclass only when ``fp8_routers`` asked for it; otherwise it is in high precision as intended)
    and, under ``fp8_routers``, routers computing their logits in their own forward (Mixtral)."""
    out = {}
    for n in plan.gemms:
        if n in plan.names or n in unconverted or any(n.startswith(a + ".") for a in attention):
            continue
        if n in plan.routers and not plan.fp8_routers:
            continue
        out[n] = (
            f"{type(model.get_submodule(n)).__name__} is not exactly nn.Linear or transformers "
            "Conv1D (its own forward may differ), so no backend converts it"
        )
    if plan.fp8_routers:
        out.update({
            r: f"{type(model.get_submodule(r)).__name__} computes the router logits in its own forward "
            "(no linear layer), so no backend converts it; it runs in high precision"
            for r in sorted(plan.routers) if r not in plan.gemms
        })
    return out


def _bf16_layers(
    plan: _Plan, keep: Mapping[str, str], fp8: Sequence[str], unconverted: Mapping[str, str]
) -> tuple[tuple[str, str], ...]:
    """``(name, reason)`` of every GEMM that stays in BF16: the layers (a fused experts module
    with some projections in FP8 is listed by its ``<experts>.<param>`` names), routers kept in
    high precision, then the spec's other names (``<experts>.<param>``)."""
    partial = {n.rpartition(".")[0] for n in fp8}
    out = [
        (n, keep.get(n, ROUTER_REASON if n in plan.routers else "recipe bf16"))
        for n in plan.gemms
        if (n in plan.names or (n in plan.routers and not plan.fp8_routers))
        and n not in fp8 and n not in partial and n not in unconverted
    ]
    listed = {n for n, _ in out}
    return (*out, *((n, why) for n, why in keep.items() if n not in plan.gemms and n not in listed))


def _warn_unconverted(unconverted: Mapping[str, str]) -> None:
    warnings.warn(
        f"fp8track.apply_fp8: {len(unconverted)} modules run their GEMMs outside FP8 "
        "and are not converted: "
        + "; ".join(f"{n}: {why}" for n, why in list(unconverted.items())[:4])
        + (" ..." if len(unconverted) > 4 else "")
        + " (listed in ApplyReport.unconverted)",
        stacklevel=3,
    )
