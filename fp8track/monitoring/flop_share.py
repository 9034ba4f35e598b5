"""The FP8 FLOP share: which part of the GEMM FLOPs the hooks saw in a fully sampled step ran in
FP8 (``fp8/fp8_flop_share``), and the one-time warning, naming the layers that did not and why,
when it is under ``fp8_share_warn_below`` (docs/monitoring.md, "FP8 share")."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fp8track.errors import warn_user
from fp8track.execution.apply import ApplyReport
from fp8track.monitoring.expert_capture import not_fp8_reason
from fp8track.monitoring.naming import run_metric
from fp8track.monitoring.records import EventRecord

FP8_SHARE_METRIC = run_metric("fp8_flop_share")
MAX_NAMED = 8
"""Layers the warning names before it says how many more there are."""


class FlopShare:
    """Measures the share at each flush with statistics; warns once (on the writer).

    Args:
        warn_below: the share under which the warning fires (``CaptureConfig.fp8_share_warn_below``).
        apply_report: what :func:`fp8track.apply_fp8` did (whether FP8 was asked for, why layers
            were kept out of it); ``None``: FP8 was asked for when some layer runs in FP8.
        is_writer: whether this process warns (every rank measures and records the event alike).
    """

    def __init__(self, warn_below: float, apply_report: ApplyReport | None, is_writer: bool) -> None:
        self.warn_below = warn_below
        self.apply_report = apply_report
        self.is_writer = is_writer
        self.share: float | None = None  # the last fully sampled step's share
        self._checked = False

    def measure(
        self, step: int, captures: Mapping[str, Any], full_sample: bool, events: list[EventRecord]
    ) -> dict[str, float]:
        """Take every capture's FLOP count since the last flush (resetting it); on a fully sampled
        step return ``{fp8/fp8_flop_share: share}`` and, the first time, add the warning's
        ``fp8_share`` event to ``events`` when the share is low."""
        flops = {fqn: cap.take_flops() for fqn, cap in captures.items()}
        total = sum(flops.values())
        if not full_sample or total == 0:
            return {}
        fp8 = sum(f for fqn, f in flops.items() if captures[fqn].plan.fp8)
        self.share = share = fp8 / total
        if not self._checked:
            self._checked = True
            events.extend(self._check(step, share, flops, captures))
        return {FP8_SHARE_METRIC: share}

    def _check(
        self, step: int, share: float, flops: Mapping[str, int], captures: Mapping[str, Any]
    ) -> list[EventRecord]:
        report = self.apply_report
        asked = report.recipe.quantizes if report is not None else any(
            cap.plan.fp8 for cap in captures.values()
        )
        if not asked or share >= self.warn_below:
            return []
        why = why_not_fp8(report)
        missing = [
            (fqn, reason_for(why, fqn) or not_fp8_reason(captures[fqn], why)  # MoE: expert / router captures
             or "its backend runs it in high precision (not an FP8 layer)")
            for fqn, f in sorted(flops.items(), key=lambda kv: -kv[1])
            if f and not captures[fqn].plan.fp8
        ]
        text = (
            f"only {100 * share:.1f}% of the GEMM FLOPs ran in FP8 at step {step} "
            f"(warning below {100 * self.warn_below:.0f}%); not in FP8: "
            + "; ".join(f"{n} ({r})" for n, r in missing[:MAX_NAMED])
            + (f"; and {len(missing) - MAX_NAMED} more" if len(missing) > MAX_NAMED else "")
        )
        if self.is_writer:
            warn_user(f"fp8track: {text}")
        data = {"share": share, "layers": [n for n, _ in missing], "reasons": [r for _, r in missing],
                "alert": True, "level": "WARN", "title": "FP8 is off for much of the model", "text": text}
        return [EventRecord("fp8_share", step, data)]


def reason_for(why: Mapping[str, str], fqn: str) -> str | None:
    """``why``'s reason for the captured layer ``fqn``. The report names layers as ``apply_fp8``
    saw them, the captures by their canonical names, which drop a LightningModule's holder
    attribute (``model.blocks.0.fc`` is captured as ``blocks.0.fc``): the one report name that
    ends in ``.<fqn>`` is the same layer."""
    if fqn in why:
        return why[fqn]
    hits = [r for n, r in why.items() if n.endswith("." + fqn)]
    return hits[0] if len(hits) == 1 else None


def why_not_fp8(report: ApplyReport | None) -> dict[str, str]:
    """Layer -> why it is not in FP8, from :func:`fp8track.apply_fp8`'s report (the fallback
    spec's reason, the backend's shape guard, a module no backend converts)."""
    if report is None:
        return {}
    out = {n: f"kept in BF16: {r}" for n, r in report.bf16_layers}
    out.update({n: f"unsupported module: {r}" for n, r in report.unconverted})
    return out
