"""The diagnosis's data: finding kinds and severities, the configuration, ``Finding`` and ``Diagnosis``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fp8track.analysis.causality import Role
from fp8track.analysis.loss_gap import GapJudgement
from fp8track.analysis.ranking import (
    LayerRisk,
)
from fp8track.analysis.spikes import SpikeEvent
from fp8track.analysis.verdict import Verdict
from fp8track.errors import ConfigError, FromDict, check_float, check_int

KINDS = (
    "mismatched_runs",
    "shared_spikes",
    "fp8_only_spikes",
    "divergence_from_start",
    "mid_training_gap",
    "downstream_drop_with_normal_loss",
    "router_divergence",
    "expert_outlier",
    "layer_outlier",
    "latent_damage",
    "healthy",
)
"""Finding kinds, in the troubleshooting path's order."""

SEVERITIES = ("high", "medium", "low", "info")


LOWER_IS_BETTER = ("loss", "ppl", "perplexity", "error", "err", "wer", "cer", "nll", "bpb")
"""An evaluation metric whose name contains one of these is better when lower; others when higher."""


@dataclass(frozen=True)
class DiagnosisConfig(FromDict):
    """The few knobs of the diagnosis, all in units of the runs' own noise (module docstring).

    Attributes:
        noise_k: a loss or evaluation gap counts above ``noise_k`` control-noise sigmas (3).
        smooth: width of the centred running median (odd); default ``max(5, n // 25)`` made odd.
        start_fraction: a gap opening within this share of the run is "from the start" (0.1).
        sustain: share of the steps from the onset to the end that must stay above the cut (0.8).
        classify_window: a spike is shared when the control spiked within this many steps (50).
        history_z: a layer's own-history shift counts above this z (4).
        outlier_z, outlier_min_score: :func:`fp8track.analysis.ranking.outliers` cut-offs.
        top_k: layers named in the BF16-fallback experiment (3).
    """

    noise_k: float = 3.0
    smooth: int | None = None
    start_fraction: float = 0.1
    sustain: float = 0.8
    classify_window: int = 50
    history_z: float = 4.0
    outlier_z: float = 3.5
    outlier_min_score: float = 3.0
    top_k: int = 3

    def __post_init__(self) -> None:
        check_float("noise_k", self.noise_k, 0.0, strict=True)
        if self.smooth is not None:
            check_int("smooth", self.smooth, 1)
        check_float("start_fraction", self.start_fraction, 0.0, strict=True)
        check_float("sustain", self.sustain, 0.0, strict=True)
        check_int("classify_window", self.classify_window, 0)
        check_float("history_z", self.history_z, 0.0, strict=True)
        check_int("top_k", self.top_k, 1)


@dataclass(frozen=True)
class Finding:
    """One answer of the diagnosis.

    Attributes:
        kind: one of :data:`KINDS`.
        severity: ``"high"``, ``"medium"``, ``"low"`` or ``"info"``.
        confidence: 0..1 (module docstring).
        title: one line.
        text: what was seen, in words, with the numbers.
        steps: the steps it concerns (onset, spike starts...).
        layers: layers it names (riskiest first).
        tensors: tensor kinds it names.
        evidence: the numbers behind it.
        next_experiments: what to try, in the troubleshooting path's order.
    """

    kind: str
    severity: str
    confidence: float
    title: str
    text: str
    steps: tuple[int, ...] = ()
    layers: tuple[str, ...] = ()
    tensors: tuple[str, ...] = ()
    evidence: Mapping[str, Any] = field(default_factory=dict)
    next_experiments: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"unknown finding kind {self.kind!r}; valid values are: {', '.join(KINDS)}")
        if self.severity not in SEVERITIES:
            raise ConfigError(
                f"unknown severity {self.severity!r}; valid values are: {', '.join(SEVERITIES)}"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind, "severity": self.severity, "confidence": round(self.confidence, 3),
            "title": self.title, "text": self.text, "steps": list(self.steps), "layers": list(self.layers),
            "tensors": list(self.tensors), "evidence": _plain(self.evidence),
            "next_experiments": list(self.next_experiments),
        }


@dataclass(frozen=True)
class Diagnosis:
    """The pair's verdict, its findings (the causal one first) and the layer ranking in causal
    order (candidate causes first, consequences last: :mod:`fp8track.analysis.diagnose.causal`).

    Attributes:
        verdict: ``healthy``, ``fp8_problem`` or ``inconclusive`` with its reason, the causal
            finding's kind and layers, and the notes (:mod:`fp8track.analysis.verdict`).
        roles: per anomalous layer, whether it is a candidate cause or a consequence (downstream
            of which layer), with its onset.
    """

    fp8_source: str
    control_source: str
    findings: tuple[Finding, ...]
    layer_ranking: tuple[LayerRisk, ...]
    ranking_window: tuple[int, int] | None
    loss: GapJudgement
    fp8_spikes: tuple[SpikeEvent, ...] = ()
    control_spikes: tuple[SpikeEvent, ...] = ()
    eval_metrics: Mapping[str, Any] = field(default_factory=dict)
    verdict: Verdict = field(default_factory=lambda: Verdict("inconclusive", "not judged"))
    roles: Mapping[str, Role] = field(default_factory=dict)

    @property
    def top(self) -> Finding:
        return self.findings[0]

    @property
    def causal_layer(self) -> str | None:
        """The layer the verdict names as the cause (``fp8_problem`` with a layer), else ``None``."""
        v = self.verdict
        return v.layers[0] if v.verdict == "fp8_problem" and v.layers else None

    def kinds(self) -> list[str]:
        return [f.kind for f in self.findings]

    def to_dict(self) -> dict[str, Any]:
        lc = self.loss
        return {
            "verdict": self.verdict.to_dict(),
            "fp8_run": self.fp8_source,
            "control_run": self.control_source,
            "findings": [f.to_dict() for f in self.findings],
            "layer_ranking": [_plain({**r.to_dict(), **_role_dict(self.roles.get(r.layer))})
                              for r in self.layer_ranking],
            "ranking_window": list(self.ranking_window) if self.ranking_window else None,
            "loss": _plain(
                {
                    "common_steps": len(lc.steps),
                    "control_noise_rel": lc.noise,
                    "tolerance_rel": lc.tolerance,
                    "final_gap_rel": lc.final_gap,
                    "max_gap_rel": lc.max_gap,
                    "onset": lc.onset_step,
                    "band_onset": lc.band_onset_step,
                    "seed_band_rel": lc.seed_band,
                    "corroborated_by": lc.corroborated_by,
                    "phase": lc.phase,
                    "smooth": lc.smooth,
                    "unit": lc.unit,
                    "unit_label": lc.unit_label,
                    "level_rel": lc.level,
                    "z": lc.z,
                    "z_cut": lc.z_cut,
                    "severity": lc.severity,
                }
            ),
            "spikes": {
                "fp8": [_plain(e.to_dict()) for e in self.fp8_spikes],
                "control": [_plain(e.to_dict()) for e in self.control_spikes],
            },
            "eval": _plain(self.eval_metrics),
            "method": "relative: the loss and evaluation gaps in units of the control's own noise, "
            "layers against the run's other layers, the control, and their own history; "
            "no fixed universal threshold",
        }


def _role_dict(role: Role | None) -> dict[str, Any]:
    """A ranking row's causal role for ``diagnosis.json`` (``role: null`` for a layer without anomaly)."""
    if role is None:
        return {"role": None}
    return {"role": role.role, "anomaly_onset": role.onset, "downstream_of": role.downstream_of,
            "role_reason": role.reason}


def _plain(obj: Any) -> Any:
    """JSON-safe copy: NaN/inf become None; tuples lists; numpy scalars floats."""
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None
    return obj


def confidence(z: float, cut: float) -> float:
    """``1 - exp(-(z / cut - 1))`` clipped to ``[0.05, 0.99]`` (module docstring)."""
    if not math.isfinite(z):
        return 0.99
    return float(min(0.99, max(0.05, 1.0 - math.exp(-(z / cut - 1.0)))))
