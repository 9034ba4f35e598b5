"""Known causes of FP8 trouble that users hit, each named only when the run says it may apply.

Every cause below is one that FP8 users met and maintainers traced (issue threads collected in
the project's research notes, section 4). A cause is suggested only when the FP8 run's metadata
(``meta.json``'s ``recipe`` and ``config.precision``, :func:`fp8track.monitoring.monitor.precision_setup`)
or its tensor statistics point there, never as a generic checklist:

=========================  =======================================================================
cause                      named when
=========================  =======================================================================
``recompute_delayed``      activation checkpointing is on and the recipe uses delayed scaling:
                           the recomputed forward records its amax into the history a second
                           time (TE #539, #1190; fixed by TE PR #646)
``compile_checkpointing``  torch.compile and activation checkpointing are both on: the recompute
                           under compile must mirror eager's precision casts (torchtitan #1056,
                           fixed by PR #1108)
``fp8_param_gather``       the parameters are stored in FP8 (``fp8_weights``): FP8 parameter
                           all-gather corrupted weights (Megatron-LM PR #6038, TE #3123) and gave
                           NaN grad norms with overlapped parameter gather (Megatron-Bridge #1255)
``tp_amax_group``          tensor parallelism is recorded (a ``tensor_parallel``/``tp_size`` > 1
                           entry, or a model-parallel strategy) with a per-tensor scaled recipe:
                           the amax must be reduced over the TP group, or the ranks' scales differ
                           (Megatron-LM PR #442)
``lora_lower_bound``       LoRA adapter layers (``lora_A``/``lora_B``...) are monitored and one of
                           them has non-finite values, an all-zero tensor or nearly all of its
                           elements underflowing: a zero amax needs a lower bound
                           (torchao #3356: ``activation_value_lb=1e-12``)
=========================  =======================================================================
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

CAUSES = (
    "recompute_delayed",
    "compile_checkpointing",
    "fp8_param_gather",
    "tp_amax_group",
    "lora_lower_bound",
)

LORA_MARKERS = ("lora_a", "lora_b", "lora_down", "lora_up", "lora_embedding")
"""Lower-cased name parts of LoRA adapter layers (PEFT's ``lora_A``/``lora_B``, diffusers'
``lora_down``/``lora_up``)."""

LORA_UNDERFLOW_PCT = 99.0
"""A LoRA tensor with at least this share of its elements flushed is as good as all zero."""

TP_KEYS = ("tensor_parallel", "tensor_parallel_size", "tp_size", "tp")
MODEL_PARALLEL_STRATEGIES = ("modelparallel", "megatron", "tensorparallel")


def precision_of(meta: Mapping[str, Any]) -> Mapping[str, Any]:
    """``config.precision`` of a run's metadata (empty when absent)."""
    cfg = meta.get("config") or {}
    prec = cfg.get("precision") if isinstance(cfg, Mapping) else None
    return prec if isinstance(prec, Mapping) else {}


def scaling_of(meta: Mapping[str, Any]) -> str:
    """The recipe's scaling (``delayed``, ``current``, ``mxfp8``, ``block``, ``none``) from the
    metadata's recipe name (``fp8_input_bf16_gemm`` scales like ``current``)."""
    recipe = meta.get("recipe")
    name = recipe.get("name") if isinstance(recipe, Mapping) else None
    if not name:
        name = str(precision_of(meta).get("recipe") or "").split(":")[0]
    name = str(name or "none")
    return {"bf16": "none", "fp8_input_bf16_gemm": "current"}.get(name, name)


def _truthy(value: Any) -> bool:
    return value not in (None, False, 0, "", "false", "False", "none", "None")


def _tensor_parallel(prec: Mapping[str, Any]) -> bool:
    for key in TP_KEYS:
        v = prec.get(key)
        if isinstance(v, bool):
            if v:
                return True
        elif isinstance(v, (int, float)) and v > 1:
            return True
    strategy = str(prec.get("strategy") or "").lower().replace("_", "")
    return any(s in strategy for s in MODEL_PARALLEL_STRATEGIES)


def _lora_trouble(rows: Iterable[Any]) -> list[str]:
    """LoRA layers whose statistics show a zero or non-finite tensor (model order)."""
    out: dict[str, None] = {}
    for r in rows:
        if not any(m in r.layer.lower() for m in LORA_MARKERS):
            continue
        s = r.stats
        nonfinite = float(s.get("nonfinite_pct", 0.0) or 0.0)
        amax = float(s.get("amax", math.nan))
        under = float(s.get("underflow_pct", 0.0) or 0.0)
        if nonfinite > 0 or amax == 0.0 or not math.isfinite(amax) or under >= LORA_UNDERFLOW_PCT:
            out[r.layer] = None
    return list(out)


def known_causes(meta: Mapping[str, Any], rows: Iterable[Any] = ()) -> dict[str, str]:
    """``{cause: next experiment}`` for each known cause the run's metadata or statistics point to
    (module docstring), in :data:`CAUSES` order."""
    prec = precision_of(meta)
    scaling = scaling_of(meta)
    ckpt, compiled = _truthy(prec.get("activation_checkpointing")), _truthy(prec.get("torch_compile"))
    out: dict[str, str] = {}
    if ckpt and scaling == "delayed":
        out["recompute_delayed"] = (
            "known cause: activation checkpointing with delayed scaling records the recomputed forward's "
            "amax "
            "twice (TE #539, #1190; fixed in TE PR #646): rerun without checkpointing, or with current "
            "scaling, "
            "or a TE version with the fix"
        )
    if ckpt and compiled:
        out["compile_checkpointing"] = (
            "known cause: torch.compile with activation checkpointing must recompute with eager's precision "
            "casts (torchtitan #1056, fixed by PR #1108): rerun without torch.compile, or without "
            "checkpointing"
        )
    if _truthy(prec.get("fp8_weights")):
        out["fp8_param_gather"] = (
            "known cause: FP8 parameters and their all-gather (Megatron-LM PR #6038, Megatron-Bridge #1255): "
            "keep the primary weights in BF16 (no FP8 parameter gather / overlapped param gather) and compare"
        )
    if _tensor_parallel(prec) and scaling in ("delayed", "current"):
        out["tp_amax_group"] = (
            "known cause: with tensor parallelism the amax must be reduced over the TP group, or ranks "
            "quantise with different scales (Megatron-LM PR #442): check the amax reduction group and "
            "compare the scales across TP ranks")
    lora = _lora_trouble(rows)
    if lora:
        out["lora_lower_bound"] = (
            f"known cause: LoRA layers with a zero or non-finite tensor ({', '.join(lora[:3])}): give the "
            "amax a lower bound (torchao Float8LinearConfig / per-row: activation_value_lb=1e-12, ao #3356)")
    return out


__all__ = ["CAUSES", "known_causes", "precision_of", "scaling_of"]
