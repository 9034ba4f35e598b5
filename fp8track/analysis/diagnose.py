"""The diagnosis: an FP8 run and its BF16 control in, findings a training team can act on out.

It follows the troubleshooting path (docs/diagnosis.md) step by step:

1. compare with the control: the step-aligned loss gap, spikes on both sides, the evaluation
   metrics (``fp8/eval/<name>``);
2. spikes at similar places in both runs -> ``shared_spikes`` (a general training problem); spikes
   only in FP8 -> ``fp8_only_spikes`` (FP8 configuration and numerics), with the recovery times;
3. a lasting gap that opens at the start -> ``divergence_from_start`` (software first: what the
   FP8 run newly enabled relative to the control, from the run metadata);
4. a lasting gap that opens later -> ``mid_training_gap`` (FP8-input BF16 GEMM, current scaling,
   block scaling, BF16 fallback of the top-ranked layers);
5. loss like the control's but an evaluation metric worse -> ``downstream_drop_with_normal_loss``
   (check the inference chain: scales, weights, precision mix);

plus ``layer_outlier`` (a layer whose statistics stand out against comparable tensors of the
model's other layers, beyond the same layer in the control, with its onset against its own history)
and ``healthy`` when nothing stands out.

**Shape.** :func:`gather_evidence` computes everything once (:class:`Evidence`); :data:`RULES` maps
each finding kind to one rule function ``(evidence, findings so far) -> findings``, run in
:data:`KINDS` order.

**No fixed universal threshold.** Every decision is relative:

* the loss gap is judged by :func:`fp8track.analysis.loss_gap.judge_gap`: in the paired FP8/control
  gap's own step-to-step noise when both runs recorded the same data fingerprint (same batches),
  else in the control's relative step-to-step noise; onset at the gap's change point, severity
  in that unit (the report says which unit);
* spikes are found by the robust rolling detector (:mod:`fp8track.analysis.spikes`) on each run and
  matched by step (:func:`fp8track.analysis.baseline.classify_spike`);
* evaluation metrics are compared in the control's loss noise (or the control's own evaluation-to-
  evaluation noise when it has at least five evaluations);
* layers are ranked like with like (:func:`fp8track.analysis.ranking.rank_layers`: within a tensor
  kind and element format, as excess over the control's shadow rows, from each layer's own onset);
* known causes users hit are added to the next experiments only when the run's metadata or
  statistics point there (:mod:`fp8track.analysis.causes`).

Confidence is ``1 - exp(-(z / z_cut - 1))`` clipped to ``[0.05, 0.99]`` where ``z`` is the
finding's evidence in its own noise unit and ``z_cut`` the cut it had to pass: evidence just at
the cut gives low confidence, three times the cut about 0.86.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from fp8track.analysis.baseline import Baseline, RunData, classify_spike
from fp8track.analysis.causes import known_causes
from fp8track.analysis.loss_gap import GapConfig, GapJudgement, judge_gap, same_batches, step_noise
from fp8track.analysis.pairing import Mismatch, align_runs, check_pairing
from fp8track.analysis.ranking import (
    MAIN_VARIANTS,
    ROW_SIGNALS,
    SIGNAL_FLOORS,
    HistoryShift,
    LayerRisk,
    history_shifts,
    outliers,
    rank_layers,
    robust_z,
    row_signals,
    separation,
)
from fp8track.analysis.spikes import SpikeConfig, SpikeEvent, detect_spikes
from fp8track.errors import ConfigError, check_float, check_int

KINDS = (
    "mismatched_runs",
    "shared_spikes",
    "fp8_only_spikes",
    "divergence_from_start",
    "mid_training_gap",
    "downstream_drop_with_normal_loss",
    "layer_outlier",
    "healthy",
)
"""Finding kinds, in the troubleshooting path's order."""

SEVERITIES = ("high", "medium", "low", "info")


LOWER_IS_BETTER = ("loss", "ppl", "perplexity", "error", "err", "wer", "cer", "nll", "bpb")
"""An evaluation metric whose name contains one of these is better when lower; others when higher."""


@dataclass(frozen=True)
class DiagnosisConfig:
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
    """Findings (most severe first, path order within a severity) and the layer ranking."""

    fp8_source: str
    control_source: str
    findings: tuple[Finding, ...]
    layer_ranking: tuple[LayerRisk, ...]
    ranking_window: tuple[int, int] | None
    loss: GapJudgement
    fp8_spikes: tuple[SpikeEvent, ...] = ()
    control_spikes: tuple[SpikeEvent, ...] = ()
    eval_metrics: Mapping[str, Any] = field(default_factory=dict)

    @property
    def top(self) -> Finding:
        return self.findings[0]

    def kinds(self) -> list[str]:
        return [f.kind for f in self.findings]

    def to_dict(self) -> dict[str, Any]:
        lc = self.loss
        return {
            "fp8_run": self.fp8_source,
            "control_run": self.control_source,
            "findings": [f.to_dict() for f in self.findings],
            "layer_ranking": [_plain(r.to_dict()) for r in self.layer_ranking],
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


# --- the pieces ----------------------------------------------------------------------------------


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


def relative_noise(values: Sequence[float]) -> float:
    """A series' relative step-to-step noise, ``1.4826 x MAD(d) / sqrt(2)`` with ``d`` the relative
    changes of consecutive finite values (:func:`fp8track.analysis.loss_gap.step_noise`): trend-free
    and spike-proof; NaN with fewer than 3 finite values."""
    return step_noise(np.array(values, dtype=np.float64), relative=True)


def compare_loss(
    fp8: Mapping[int, float], control: Mapping[int, float], config: DiagnosisConfig | None = None,
    paired: bool = False, seed_band: float | None = None,
) -> GapJudgement:
    """Step-aligned loss comparison and the onset of a lasting gap, judged by
    :func:`fp8track.analysis.loss_gap.judge_gap`: in the paired FP8/control gap's own noise when both
    runs saw the same batches (``paired``), else in the control's step-to-step noise; the onset is
    the gap's change point, its phase ``"start"`` or ``"mid"``, its severity in that noise unit;
    ``seed_band`` overrides :attr:`fp8track.analysis.loss_gap.GapConfig.seed_band`."""
    cfg = config or DiagnosisConfig()
    band = {} if seed_band is None else {"seed_band": seed_band}
    return judge_gap(
        fp8,
        control,
        paired,
        GapConfig(
            noise_k=cfg.noise_k,
            smooth=cfg.smooth,
            sustain=min(cfg.sustain, 1.0),
            start_fraction=cfg.start_fraction,
            **band,
        ),
    )


def spike_config_for(n_steps: int) -> SpikeConfig:
    """The spike detector's defaults, with the window shortened for short runs (a quarter of the
    logged steps, at least 8, at most the default 128)."""
    window = int(min(128, max(8, n_steps // 4)))
    return SpikeConfig(window=window, warmup=min(64, max(8, window // 2)))


def newly_enabled(fp8_meta: Mapping[str, Any], control_meta: Mapping[str, Any]) -> dict[str, Any]:
    """Precision options the FP8 run has that the control does not (from ``config.precision`` of
    the run metadata, :func:`fp8track.monitoring.monitor.precision_setup`), plus the FP8 recipe."""
    def setup(meta: Mapping[str, Any]) -> Mapping[str, Any]:
        cfg = meta.get("config") or {}
        return cfg.get("precision") or {} if isinstance(cfg, Mapping) else {}

    mine, theirs = setup(fp8_meta), setup(control_meta)
    out: dict[str, Any] = {}
    for key, value in mine.items():
        if value in (None, False, "", "bf16", "none") or value == theirs.get(key):
            continue
        out[key] = value
    recipe = fp8_meta.get("recipe")
    if "recipe" not in out and isinstance(recipe, Mapping) and recipe.get("name") not in (None, "bf16"):
        out["recipe"] = recipe.get("name")
    return out


OPTION_LABELS = {
    "recipe": "the FP8 recipe itself (run the control's precision with only the recipe changed)",
    "fp8_weights": "FP8 weights/parameters (keep master weights in BF16/FP32)",
    "cpu_offloading": "CPU offloading",
    "activation_checkpointing": "activation checkpointing",
    "torch_compile": "torch.compile",
    "fused_optimizer": "the fused/foreach optimizer",
    "precision_plugin": "the precision plugin",
    "precision": "the precision setting",
    "strategy": "the distributed strategy",
}


def _eval_direction(name: str) -> int:
    """+1 when larger is better, -1 when smaller is better (:data:`LOWER_IS_BETTER`)."""
    low = name.lower()
    return -1 if any(tok in low for tok in LOWER_IS_BETTER) else 1


def compare_evals(
    fp8: Mapping[str, Mapping[int, float]], control: Mapping[str, Mapping[int, float]], loss_noise: float,
    noise_k: float,
) -> dict[str, dict[str, Any]]:
    """Per evaluation metric both runs have: the values at the last common evaluation step, the
    relative change in the "worse" direction, the noise unit and its z."""
    out: dict[str, dict[str, Any]] = {}
    for name in sorted(set(fp8) & set(control)):
        common = sorted(set(fp8[name]) & set(control[name]))
        if not common:
            continue
        step = common[-1]
        a, b = float(fp8[name][step]), float(control[name][step])
        direction = _eval_direction(name)
        worse = -direction * (a - b) / abs(b) if b != 0 else (math.inf if -direction * (a - b) > 0 else 0.0)
        if not math.isfinite(a):
            worse = math.inf
        series = [control[name][s] for s in sorted(control[name])]
        noise = loss_noise
        source = "control loss noise"
        if len(series) >= 5:
            own = relative_noise(series)
            if math.isfinite(own) and own > 0:
                noise, source = max(own, 1e-6), "control evaluation noise"
        z = worse / noise if noise > 0 else math.inf
        out[name] = {
            "step": step,
            "fp8": a,
            "control": b,
            "worse_rel": worse,
            "noise_rel": noise,
            "noise_source": source,
            "z": z,
            "dropped": z > noise_k,
            "higher_is_better": direction > 0,
        }
    return out


# --- the evidence every rule reads ----------------------------------------------------------------


@dataclass(frozen=True)
class Evidence:
    """What the rules judge, computed once per diagnosis.

    Attributes:
        fp8, control: the two runs.
        cfg: the configuration.
        loss: the step-aligned loss comparison.
        fp8_spikes: spikes and non-finite events of the FP8 loss; ``control_base`` the control's.
        fp8_rows, control_rows: tensor-statistics rows of both runs.
        shifts: own-history shifts of the FP8 run's (layer, tensor) pairs, strongest first.
        ranking: the layer ranking (:func:`fp8track.analysis.ranking.rank_layers`, against the control).
        outs: its outliers.
        named: the layers a numerics finding names: the outliers, else the top-ranked (with ties).
        model_order: the FP8 run's layers in model order (FP8 layers, then BF16 ones).
        evals: per evaluation metric, :func:`compare_evals`.
        row_spacing: steps between two sampled steps of the tensor statistics.
        causes: the known causes the run points to (:func:`fp8track.analysis.causes.known_causes`).
        paired_spikes: spikes of the FP8/control loss ratio when both runs saw the same batches
            (:func:`paired_spikes`); empty otherwise.
    """

    fp8: RunData
    control: RunData
    cfg: DiagnosisConfig
    loss: GapJudgement
    fp8_spikes: tuple[SpikeEvent, ...]
    control_base: Baseline
    fp8_rows: tuple[Any, ...]
    control_rows: tuple[Any, ...]
    shifts: tuple[HistoryShift, ...]
    ranking: tuple[LayerRisk, ...]
    outs: tuple[LayerRisk, ...]
    named: tuple[str, ...]
    model_order: tuple[str, ...]
    evals: Mapping[str, Mapping[str, Any]]
    row_spacing: int
    causes: Mapping[str, str]
    paired_spikes: tuple[SpikeEvent, ...] = ()

    @property
    def nonfinite(self) -> list[SpikeEvent]:
        return [e for e in self.fp8_spikes if e.kind == "nonfinite"]

    @property
    def gap_z(self) -> float:
        """The lasting gap's level in its noise unit (:func:`fp8track.analysis.loss_gap.judge_gap`)."""
        return self.loss.z

    def loss_evidence(self) -> dict[str, Any]:
        lc = self.loss
        i = lc.steps.index(lc.onset_step) if lc.onset_step is not None else 0
        return {
            "onset_step": lc.onset_step,
            "gap_rel_at_end": lc.final_gap,
            "max_gap_rel": lc.max_gap,
            "control_noise_rel": lc.noise,
            "tolerance_rel": lc.tolerance,
            "gap_in_noise_units": self.gap_z,
            "fp8_loss_at_onset": lc.fp8[i],
            "control_loss_at_onset": lc.control[i],
            "fp8_final_loss": lc.fp8[-1],
            "control_final_loss": lc.control[-1],
            "gap_level_rel": lc.level,
            "gap_z_cut": lc.z_cut,
            "noise_unit": lc.unit,
            "nonfinite_steps": [e.start_step for e in self.nonfinite],
        }


def corroborating_break(
    outs: Sequence[LayerRisk], loss: GapJudgement, loss_spacing: int, row_spacing: int
) -> str | None:
    """The outlier layer whose own-history break explains a gap that ends inside the seed band
    (``loss.band_onset_step``): it broke no later than the gap's onset plus the onsets' resolution
    (:func:`breaks_after_gap`) and no earlier than twice that resolution before it; ``None`` when
    no outlier did (the gap stays no finding)."""
    if loss.band_onset_step is None:
        return None
    res = loss.smooth * loss_spacing + row_spacing
    for r in outs:
        if r.onset is not None and loss.band_onset_step - 2 * res <= r.onset <= loss.band_onset_step + res:
            return r.layer
    return None


def breaks_after_gap(r: LayerRisk, loss: GapJudgement, loss_spacing: int, row_spacing: int) -> bool:
    """Whether layer ``r`` broke on its own (its own-history onset) clearly after a lasting loss gap
    opened: later than the gap's onset by more than the gap's smoothing width (``loss.smooth``
    logged steps ``loss_spacing`` apart) plus one statistics sampling interval (``row_spacing``):
    the two onsets' resolution. Such a layer cannot explain the gap: it is a separate,
    later problem, judged on its own severity (:func:`finding_order`)."""
    if loss.onset_step is None or r.onset is None:
        return False
    return r.onset > loss.onset_step + loss.smooth * loss_spacing + row_spacing


def gather_evidence(
    fp8: RunData, control: RunData, cfg: DiagnosisConfig, loss_key: str | None = None
) -> Evidence:
    """Everything :data:`RULES` read: the loss comparison, spikes, rows, shifts, ranking, evaluations."""
    fkey, ckey = fp8.loss_key(loss_key), control.loss_key(loss_key)
    fl, cl = fp8.metrics[fkey], control.metrics[ckey]
    loss = compare_loss(fl, cl, cfg, paired=same_batches(fp8.meta, control.meta))
    steps = loss.steps
    spacing = _loss_spacing(loss)
    scfg = spike_config_for(len(steps))
    fp8_spikes = detect_spikes({s: fl[s] for s in steps}, scfg)
    ctl_base = Baseline.from_series(control.source, {s: cl[s] for s in steps}, scfg, key=ckey)
    fp8_rows, ctl_rows = tuple(fp8.tensor_rows), tuple(control.tensor_rows)
    ranking = tuple(
        rank_layers(fp8_rows, control=ctl_rows or None, events=fp8.events, history_z=cfg.history_z)
    )
    outs = tuple(outliers(ranking, cfg.outlier_z, cfg.outlier_min_score))
    row_spacing = _row_spacing(fp8_rows) or spacing
    if (cause := corroborating_break(outs, loss, spacing, row_spacing)) is not None:
        # The seed band is there because one pair cannot tell drift from damage; a layer that broke
        # on its own just before the gap opened tells them apart: the gap is judged without it.
        loss = replace(compare_loss(fl, cl, cfg, paired=loss.unit == "paired", seed_band=0.0),
                       corroborated_by=cause)
    # The layers a lasting gap names: those that can explain it, not one that broke on its own later.
    later = {r.layer for r in ranking if breaks_after_gap(r, loss, spacing, row_spacing)}
    top = [r.layer for r in ranking if ranking and r.rank == ranking[0].rank and r.layer not in later]
    named = tuple(
        [r.layer for r in outs if r.layer not in later][: cfg.top_k]
        or [r.layer for r in ranking if r.layer not in later][: max(cfg.top_k, len(top))]
    )
    fp8_layers = list(fp8.meta.get("fp8_layers") or [])
    model_order = tuple(fp8_layers + [n for n in (fp8.meta.get("bf16_layers") or []) if n not in fp8_layers])
    evals = compare_evals(fp8.eval_metrics(), control.eval_metrics(), loss.noise, cfg.noise_k)
    return Evidence(
        fp8,
        control,
        cfg,
        loss,
        tuple(fp8_spikes),
        ctl_base,
        fp8_rows,
        ctl_rows,
        tuple(history_shifts(fp8_rows)),
        ranking,
        outs,
        named,
        model_order,
        evals,
        row_spacing,
        known_causes(fp8.meta, fp8_rows),
        paired_spikes(fl, cl, steps, scfg) if loss.unit == "paired" else (),
    )


def paired_spikes(
    fp8: Mapping[int, float], control: Mapping[int, float], steps: Sequence[int], config: SpikeConfig
) -> tuple[SpikeEvent, ...]:
    """Spikes of the ratio ``fp8 / control`` over ``steps``, for two runs that saw the same batches.

    The batches' own difficulty moves both losses alike and cancels in the ratio, so an FP8-only
    excursion too small to stand out of the raw loss's batch-to-batch noise (a slow 10 % bump over
    twenty steps while a delayed scale recovers) stands out of the ratio's much smaller noise. The
    same detector, thresholds and recovery rule as for the raw loss; a data spike both runs take
    alike leaves the ratio flat, so every event here is FP8-only by construction."""
    ratio = {
        s: fp8[s] / control[s]
        for s in steps
        if math.isfinite(fp8[s]) and math.isfinite(control[s]) and control[s] > 0
    }
    return tuple(e for e in detect_spikes(ratio, config) if e.kind == "spike")


# --- the rules: one function per finding kind ----------------------------------------------------


def _severity(z: float, cut: float) -> str:
    if not math.isfinite(z) or z >= 3 * cut:
        return "high"
    return "medium" if z >= 1.5 * cut else "low"


def _layers_near(
    rows: Sequence[Any], step: int, spacing: int, history_z: float
) -> list[tuple[str, str, str, float]]:
    """``(layer, tensor, signal, z)`` of (layer, tensor) pairs whose statistics at the sampled step
    nearest ``step`` (within ``spacing``) jump against their own other samples, strongest first."""
    by_key: dict[tuple[str, str], dict[int, dict[str, float]]] = {}
    for r in rows:
        if r.variant in MAIN_VARIANTS:
            by_key.setdefault((r.layer, r.tensor), {})[int(r.step)] = row_signals(r.stats)
    hits = []
    for (layer, tensor), per_step in by_key.items():
        near = [s for s in per_step if step - spacing <= s <= step + 1]
        if not near or len(per_step) < 4:
            continue
        s0 = max(near)
        order = sorted(per_step)
        for sig in ROW_SIGNALS:
            z = robust_z([per_step[s][sig] for s in order], SIGNAL_FLOORS[sig])[order.index(s0)]
            if math.isfinite(z) and z > history_z:
                hits.append((layer, tensor, sig, float(z)))
    best: dict[tuple[str, str], tuple[str, str, str, float]] = {}
    for h in hits:
        if (h[0], h[1]) not in best or h[3] > best[(h[0], h[1])][3]:
            best[(h[0], h[1])] = h
    return sorted(best.values(), key=lambda h: -h[3])


def _classified_spikes(ev: Evidence) -> tuple[list[Any], list[Any]]:
    """FP8 spikes split into (shared with the control, FP8 only), each as ``(event, classification)``.
    An FP8 spike that never recovers and starts within one smoothing window of a lasting gap's onset
    is that gap's own step up, judged by the gap rules."""
    shared: list[Any] = []
    only: list[Any] = []
    lc = ev.loss
    spacing = max(1, int(np.median(np.diff(lc.steps)))) if len(lc.steps) > 1 else 1

    def gap_step_up(e: SpikeEvent) -> bool:
        return (lc.onset_step is not None and e.status == "not_recovered"
                and e.start_step >= lc.onset_step - lc.smooth * spacing)

    for e in ev.fp8_spikes:
        if e.kind == "spike" and not gap_step_up(e):
            cls = classify_spike(e, ev.control_base, ev.cfg.classify_window)
            (shared if cls.label == "shared" else only).append((e, cls))
    # Excursions of the paired ratio that the raw loss's noise hid: FP8-only (the data cancels).
    seen = [e.start_step for e, _ in shared + only]
    for e in ev.paired_spikes:
        if not gap_step_up(e) and all(abs(e.start_step - s) > ev.cfg.classify_window for s in seen):
            only.append((e, None))
    only.sort(key=lambda ec: ec[0].start_step)
    return shared, only


def rule_shared_spikes(ev: Evidence, found: Sequence[Finding]) -> list[Finding]:
    """Path step 2: FP8 spikes with a control spike within ``classify_window`` steps."""
    shared, _ = _classified_spikes(ev)
    if not shared:
        return []
    zs = [e.z_score for e, _ in shared if math.isfinite(e.z_score)]
    return [
        Finding(
            "shared_spikes",
            "low",
            confidence(len(shared) + 1.0, 1.0),
            f"{len(shared)} loss spike(s) also in the BF16 control: a general training problem, not FP8",
            "The FP8 run spiked where the control did (within "
            f"{ev.cfg.classify_window} steps). Look at data, learning rate and optimizer state first.",
            steps=tuple(e.start_step for e, _ in shared),
            evidence={
                "spikes": [
                    {
                        "start_step": e.start_step,
                        "control_start_step": c.control_start_step,
                        "rel_excess": e.rel_excess,
                        "recover_steps": e.recover_steps,
                        "control_recover_steps": c.control_recover_steps,
                        "z": e.z_score,
                    }
                    for e, c in shared
                ],
                "max_z": max(zs) if zs else math.inf,
            },
            next_experiments=(
                "inspect the batches at these steps (data quality, sequence lengths) and the learning-rate "
                "schedule",
                "lower the learning rate or add warm-up / gradient clipping; the same change should help "
                "the control",
                "only if FP8 recovers much more slowly than the control, treat them as FP8 spikes",
            ),
        )
    ]


def rule_fp8_only_spikes(ev: Evidence, found: Sequence[Finding]) -> list[Finding]:
    """Path step 2: FP8 spikes without a control spike nearby; the layers that jump at them."""
    _, only = _classified_spikes(ev)
    if not only:
        return []
    cfg = ev.cfg
    slow = [e for e, c in only if e.status == "not_recovered"]
    ctl_rec = sorted(e.recover_steps for e in ev.control_base.spikes if e.recover_steps is not None)
    fp8_rec = sorted(e.recover_steps for e, _ in only if e.recover_steps is not None)
    zmax = max((e.z_score for e, _ in only if math.isfinite(e.z_score)), default=math.inf)
    layer_hits: dict[tuple[str, str], float] = {}
    for e, _ in only:
        for layer, tensor, _sig, z in _layers_near(ev.fp8_rows, e.start_step, ev.row_spacing, cfg.history_z):
            layer_hits[(layer, tensor)] = layer_hits.get((layer, tensor), 0.0) + z
    hits = sorted(layer_hits.items(), key=lambda kv: -kv[1])
    layers = tuple(dict.fromkeys(k[0] for k, _ in hits))[: cfg.top_k]
    tensors = tuple(dict.fromkeys(k[1] for k, _ in hits if k[0] in layers))
    # A layer broken for most of the run does not jump at a spike against its own history; the
    # layers that stand out against the others (and the control) are then the suspects.
    standing = () if layers else tuple(r.layer for r in ev.outs)[: cfg.top_k]
    if standing:
        layers, tensors = standing, tuple(dict.fromkeys(r.tensor for r in ev.outs if r.layer in standing))
    sev = "high" if slow or len(only) >= 3 else "medium"
    conf = confidence(zmax, 6.0) if len(only) == 1 else max(confidence(zmax, 6.0), 0.8)
    return [Finding(
        "fp8_only_spikes", sev, conf,
        f"{len(only)} loss spike(s) only in FP8, first at step {only[0][0].start_step}",
        f"The control did not spike within {cfg.classify_window} steps of these. Median FP8 recovery "
        f"{_median_or_none(fp8_rec)} steps vs control spikes {_median_or_none(ctl_rec)}; "
        f"{len(slow)} did not recover. "
        + (f"Layers whose statistics jump at the spikes: {', '.join(layers)}." if layers and not standing
           else f"No layer's statistics jump at the spikes; standing out over the run: {', '.join(layers)}."
           if standing else ""),
        steps=tuple(e.start_step for e, _ in only), layers=layers, tensors=tensors,
        evidence={"spikes": [{"start_step": e.start_step, "rel_excess": e.rel_excess, "z": e.z_score,
                              "recover_steps": e.recover_steps, "status": e.status} for e, _ in only],
                  "fp8_median_recover_steps": _median_or_none(fp8_rec),
                  "control_median_recover_steps": _median_or_none(ctl_rec),
                  "layer_jumps": [{"layer": k[0], "tensor": k[1], "z_sum": v} for k, v in hits[:10]],
                  "layers_standing_out": list(standing),
                  "known_causes": sorted(ev.causes)},
        next_experiments=_numerics_experiments(layers, (), cfg) + tuple(ev.causes.values()),
    )]


def rule_divergence_from_start(ev: Evidence, found: Sequence[Finding]) -> list[Finding]:
    """Path step 3: a lasting gap from the start; software first (what the FP8 run newly enabled)."""
    lc = ev.loss
    if lc.onset_step is None or lc.phase != "start":
        return []
    new = newly_enabled(ev.fp8.meta, ev.control.meta)
    evidence = {**ev.loss_evidence(), "newly_enabled": new, "known_causes": sorted(ev.causes)}
    exps = [f"switch off {OPTION_LABELS.get(k, k)} ({k}={v})" for k, v in new.items() if k != "recipe"]
    exps.extend(ev.causes.values())
    exps.append("re-enable the options one at a time and rerun the first steps against the control")
    top = ev.ranking[0].layer if ev.ranking else "n/a"
    exps.append(f"compare the first sampled step's tensor statistics (non-finite, overflow) layer by layer: "
                f"top of the ranking is {top}")
    if "recipe" in new:
        exps.insert(0, f"keep everything as in the control except the FP8 recipe ({new['recipe']}): "
                       "if that alone diverges, go to the numerics experiments")
    return [Finding(
        "divergence_from_start", "high" if lc.severity == "high" else "medium",
        confidence(ev.gap_z, lc.z_cut),
        f"FP8 diverges from the start (gap opens at step {lc.onset_step})",
        f"The FP8 loss departs from the control from step {lc.onset_step} on and never comes back: "
        f"{100 * lc.final_gap:+.1f}% at the end, {ev.gap_z:.0f}x {lc.unit_label} "
        f"({100 * lc.noise:.2f}%). Suspect software first. Newly enabled relative to the control: "
        + (", ".join(f"{k}={v}" for k, v in new.items()) or "nothing recorded") + ".",
        steps=(lc.onset_step,), layers=tuple(ev.named[:1]), evidence=evidence, next_experiments=tuple(exps),
    )]


def rule_mid_training_gap(ev: Evidence, found: Sequence[Finding]) -> list[Finding]:
    """Path step 4: a lasting gap that opens later; the numerics experiments on the named layers."""
    lc, cfg = ev.loss, ev.cfg
    if lc.onset_step is None or lc.phase != "mid":
        return []
    named = ev.named
    return [Finding(
        "mid_training_gap", "high" if lc.severity == "high" else "medium", confidence(ev.gap_z, lc.z_cut),
        f"FP8 falls behind the control mid-training (from step {lc.onset_step})",
        f"The FP8 loss tracked the control until step {lc.onset_step}, then stayed above it: "
        f"{100 * lc.level:+.1f}% since then, {ev.gap_z:.0f}x {lc.unit_label} "
        f"({100 * lc.noise:.2f}%). Top-ranked layers: {', '.join(named)}."
        + (f" The gap ends inside the {100 * lc.seed_band:.0f}% seed band, but {lc.corroborated_by} broke "
           "on its own just before it opened: damage, not drift." if lc.corroborated_by else ""),
        steps=(lc.onset_step,), layers=named,
        tensors=tuple(dict.fromkeys(r.tensor for r in ev.ranking if r.layer in named)),
        evidence={**ev.loss_evidence(), "known_causes": sorted(ev.causes)},
        next_experiments=_numerics_experiments(named, ev.model_order, cfg) + tuple(ev.causes.values()),
    )]


def rule_downstream_drop(ev: Evidence, found: Sequence[Finding]) -> list[Finding]:
    """Path step 5: an evaluation metric worse than the control's while the loss is normal. A drop
    no larger than the training loss's own level gap (plus ``noise_k`` of the metric's noise) is
    the training gap seen again, not a problem of the inference path."""
    lc, cfg = ev.loss, ev.cfg
    level = max(lc.level, 0.0) if math.isfinite(lc.level) else 0.0
    dropped = {k: v for k, v in ev.evals.items()
               if v["dropped"] and v["worse_rel"] - level > cfg.noise_k * v["noise_rel"]}
    if not dropped or lc.onset_step is not None or ev.nonfinite:
        return []
    worst_name, worst = max(dropped.items(), key=lambda kv: kv[1]["z"])
    return [
        Finding(
            "downstream_drop_with_normal_loss",
            "high" if worst["z"] >= 3 * cfg.noise_k else "medium",
            confidence(worst["z"], cfg.noise_k),
            f"Evaluation drops ({', '.join(dropped)}) while the training loss matches the control",
            f"{worst_name}: {worst['fp8']:.4g} vs control {worst['control']:.4g} at step {worst['step']} "
            f"({100 * worst['worse_rel']:.1f}% worse, {worst['z']:.0f}x the {worst['noise_source']}), while "
            f"the "
            f"training loss stays within {100 * lc.tolerance:.2f}% of the control. Loss alone misses "
            "problems in the inference path: scaling factors, weight loading, precision mix.",
            steps=(int(worst["step"]),),
            layers=tuple(ev.named[:1]),
            evidence={"eval": dropped, "loss_final_gap_rel": lc.final_gap},
            next_experiments=(
                "check the inference chain: fp8track check-inference CKPT (trained vs fresh scales vs BF16, "
                "per-layer output error, checkpoint reload of weights and amax histories)",
                "verify inference loads the trained scaling state (amax histories, scales) and the final "
                "weights",
                "use FP8 training + FP8 inference as the control: BF16 inference of an FP8-trained model "
                "can add error",
            ),
        )
    ]


TROUBLE_KINDS = (
    "fp8_only_spikes",
    "divergence_from_start",
    "mid_training_gap",
    "downstream_drop_with_normal_loss",
)
ERROR_SIGNALS = ("rel_error_db", "cos_loss")
CORROBORATE_Z = 2.0
"""Robust z (against comparable tensors of the other layers) of a layer's relative error (incl. the
error of its non-outlier elements) or cosine loss from which its quantisation error is said to stand
out (reported with the layers to watch)."""

CLEAR_SEPARATION = 2.0
"""An outlier scoring less than this many times the best other layer is a near tie: at most
``medium`` severity, whatever its score."""


def _error_stands_out(r: LayerRisk) -> bool:
    return any(math.isfinite(r.z.get(s, math.nan)) and r.z[s] >= CORROBORATE_Z for s in ERROR_SIGNALS)


def _trouble(ev: Evidence, found: Sequence[Finding]) -> bool:
    """The loss or the evaluation shows trouble: a finding of :data:`TROUBLE_KINDS`, or an
    evaluation metric worse than the control's beyond its noise (also when the training loss's own
    level gap explains it, which the per-step noise may hide)."""
    return any(f.kind in TROUBLE_KINDS for f in found) or any(v["dropped"] for v in ev.evals.values())


def _watch(ev: Evidence, found: Sequence[Finding]) -> list[LayerRisk]:
    """Outliers without loss or evaluation trouble: statistics nominate, the loss decides, so they
    are layers to watch under ``healthy``, whatever their error (which the finding reports)."""
    return [] if _trouble(ev, found) else list(ev.outs)


def _own_shift(ev: Evidence, layer: str, tensor: str) -> dict[str, Any] | None:
    h = next((h for h in ev.shifts if h.layer == layer and h.tensor == tensor), None)
    return h.to_dict() if h is not None and h.z > ev.cfg.history_z else None


def rule_layer_outlier(ev: Evidence, found: Sequence[Finding]) -> list[Finding]:
    """A layer that stands out against comparable tensors of the other layers (beyond the control)
    while the loss or the evaluation shows trouble; its onset from its own history."""
    cfg, watch = ev.cfg, _watch(ev, found)
    out = []
    for r in (r for r in ev.outs if r not in watch):
        own = _own_shift(ev, r.layer, r.tensor)
        st = r.stats.get(r.tensor, {})
        sep = separation(r, ev.ranking, ev.outs)
        sev = _severity(r.score, cfg.outlier_min_score)
        if sev == "high" and sep < CLEAR_SEPARATION:  # a near tie is not a clear culprit
            sev = "medium"
        worst_sig = max(r.z, key=lambda k: r.z[k] if math.isfinite(r.z[k]) else -math.inf)
        base = "the control's same layer" if r.excess else "the model's other layers"
        later = breaks_after_gap(r, ev.loss, _loss_spacing(ev.loss), ev.row_spacing)
        out.append(
            Finding(
                "layer_outlier",
                sev,
                confidence(r.score, cfg.outlier_min_score) * (1.0 if sep >= CLEAR_SEPARATION else 0.5),
                f"Layer {r.layer} ({r.tensor}) stands out" + (f" from step {own['step']}" if own else ""),
                f"Risk score {r.score:.1f}, {sep:.1f}x the next layer's, against comparable {r.tensor} "
                f"tensors "
                f"({r.fmt}) of the other layers, as excess over {base}; worst signal {worst_sig} "
                f"(z {r.z[worst_sig]:.1f}): SQNR {st.get('sqnr_db', math.nan):.1f} dB (without its largest "
                f"element "
                f"{st.get('bulk_sqnr_db', math.nan):.1f} dB), underflow "
                f"{st.get('underflow_pct', math.nan):.2f}%, "
                f"cos {st.get('cos', math.nan):.5f}, |drift| {st.get('abs_drift_log2', math.nan):.2f} "
                f"binades."
                + (
                    f" Against its own history, {own['signal']} worsened from step {own['step']} (z "
                    f"{own['z']:.1f})."
                    if own
                    else ""
                )
                + (
                    f" It broke at step {r.onset}, after the loss gap opened (step {ev.loss.onset_step}): "
                    "it does not explain that gap but is a separate, later problem."
                    if later
                    else ""
                ),
                steps=(own["step"],) if own else (),
                layers=(r.layer,),
                tensors=(r.tensor,),
                evidence={
                    "score": r.score,
                    "separation": sep,
                    "rank": r.rank,
                    "tied": list(r.tied),
                    "z": dict(r.z),
                    "stats": st,
                    "own_history": own,
                    "excess_over_control": r.excess,
                    "breaks_after_gap": later,
                },
                next_experiments=(
                    f"look for outlier features entering {r.layer}'s {r.tensor} (amax over steps)",
                    f"rerun with {r.layer} in BF16 (--bf16-layers {r.layer}) and compare the loss gap",
                    "try current or block scaling for this layer's tensors (what-if rows show the expected "
                    "error)",
                    *ev.causes.values(),
                ),
            )
        )
    return out


def rule_healthy(ev: Evidence, found: Sequence[Finding]) -> list[Finding]:
    """None of the other rules fired; the layers to watch are noted."""
    if found:
        return []
    lc, watch = ev.loss, _watch(ev, found)
    best = ev.ranking[0] if ev.ranking else None
    ties = f", tied with {', '.join(best.tied)}" if best and best.tied else ""
    return [
        Finding(
            "healthy",
            "info",
            confidence(lc.z_cut / max(abs(lc.max_gap) / lc.noise, 1e-9), 1.0),
            "FP8 matches the BF16 control",
            (
                f"Loss gap {100 * lc.final_gap:+.2f}% at the end: a gap from step {lc.band_onset_step} "
                f"that ends inside the {100 * lc.seed_band:.0f}% band healthy FP8/BF16 pairs drift apart "
                "by on the same batches (rerun another seed to tell drift from damage)"
                if lc.band_onset_step is not None
                else f"Loss gap {100 * lc.final_gap:+.2f}% at the end, within the cut of "
                f"{100 * lc.tolerance:.2f}% ({lc.z_cut:.1f}x {lc.unit_label}, {100 * lc.noise:.2f}%)"
            )
            + "; no FP8-only spikes; no evaluation "
            "drop; no layer stands out "
            "against the others more than in the control with an error to show for it"
            + (f" (highest risk score {best.score:.1f}, {best.layer}{ties})." if best else ".")
            + (
                " To watch: "
                + ", ".join(
                    f"{r.layer} ({r.tensor}, worst signal {max(r.z, key=lambda k: r.z[k])})" for r in watch
                )
                + " stand out against comparable tensors of the other layers"
                + (" with a larger quantisation error" if any(_error_stands_out(r) for r in watch) else "")
                + ", without any loss or evaluation impact: rerun the diagnosis after longer training."
                if watch
                else ""
            ),
            layers=tuple(r.layer for r in watch),
            evidence={
                "final_gap_rel": lc.final_gap,
                "max_gap_rel": lc.max_gap,
                "control_noise_rel": lc.noise,
                "tolerance_rel": lc.tolerance,
                "noise_unit": lc.unit,
                "band_onset_step": lc.band_onset_step,
                "eval": ev.evals,
                "top_layer": best.layer if best else None,
                "top_score": best.score if best else None,
                "top_tied_with": list(best.tied) if best else [],
                "watch": [
                    {
                        "layer": r.layer,
                        "tensor": r.tensor,
                        "score": r.score,
                        "z": dict(r.z),
                        "error_stands_out": _error_stands_out(r),
                    }
                    for r in watch
                ],
            },
            next_experiments=(
                "keep monitoring at a lower sampling rate; rerun the diagnosis after longer training",
            ),
        )
    ]


Rule = Callable[[Evidence, Sequence[Finding]], list[Finding]]

RULES: Mapping[str, Rule] = {
    "shared_spikes": rule_shared_spikes,
    "fp8_only_spikes": rule_fp8_only_spikes,
    "divergence_from_start": rule_divergence_from_start,
    "mid_training_gap": rule_mid_training_gap,
    "downstream_drop_with_normal_loss": rule_downstream_drop,
    "layer_outlier": rule_layer_outlier,
    "healthy": rule_healthy,
}
"""One rule per finding kind, run in :data:`KINDS` order; each sees the findings of the rules
before it (``layer_outlier`` asks whether the loss showed trouble, ``healthy`` whether anything fired)."""


def _median_or_none(xs: Sequence[int]) -> float | None:
    return float(np.median(xs)) if xs else None


def _numerics_experiments(
    top_layers: Sequence[str], all_layers: Sequence[str], cfg: DiagnosisConfig
) -> tuple[str, ...]:
    """Step 4 of the path, in its order; first/last layers only where they are among the top."""
    exps = [
        "FP8 inputs with a BF16 GEMM (recipe fp8_input_bf16_gemm): separates quantisation of the "
        "operands from the FP8 GEMM itself",
        "current scaling (recipe current): removes the delayed scale's lag behind the amax",
        "block scaling (recipes mxfp8, block): one scale per 32/128 elements absorbs outliers",
    ]
    if top_layers:
        names = ",".join(top_layers[: cfg.top_k])
        hint = ""
        if all_layers and (
            all_layers[0] in top_layers[: cfg.top_k] or all_layers[-1] in top_layers[: cfg.top_k]
        ):
            hint = " (the first/last layer is among them, as is often the case)"
        exps.append(
            f"keep the top-ranked layers in BF16: --bf16-layers {names}{hint}; measurement decides the set"
        )
    else:
        exps.append(
            "keep the top-ranked layers of layer_ranking in BF16 (auto:K); measurement decides the set"
        )
    return tuple(exps)


SYMPTOM_KINDS = tuple(k for k in KINDS if k not in ("mismatched_runs", "layer_outlier", "healthy"))
"""The path's failure kinds, read from the loss and evaluation curves: what is wrong with the run."""


def finding_order(f: Finding) -> tuple[int, int, int]:
    """Sort key of the findings: a symptom of medium or high severity first (what is wrong: spikes, a
    gap, an evaluation drop), then by severity and the path's order. A layer outlier says *where* to
    look; it is raised only with loss or evaluation trouble, so it follows the symptom it explains
    rather than hiding it (two high layer outliers above a medium FP8-only spike read as "no spike").
    A layer outlier that broke on its own after the lasting gap opened (``breaks_after_gap``) is a
    separate problem, not an explanation: it competes with the symptoms on severity."""
    symptom_first = 0 if f.kind in SYMPTOM_KINDS and f.severity in ("high", "medium") else 1
    if f.kind == "layer_outlier" and f.evidence.get("breaks_after_gap"):
        # It broke after the gap opened, so the gap does not explain it: its own severity decides.
        symptom_first = 0
    return symptom_first, SEVERITIES.index(f.severity), KINDS.index(f.kind)


def diagnose(fp8: RunData, control: RunData, config: DiagnosisConfig | None = None,
             loss_key: str | None = None) -> Diagnosis:
    """Diagnose ``fp8`` against its BF16 ``control`` (module docstring): gather the evidence once,
    run :data:`RULES` in the path's order, sort the findings (:func:`finding_order`).

    Raises:
        ConfigError: when the runs have no loss metric or fewer than 3 common loss steps.
    """
    # Pairing before judging (fp8track.analysis.pairing): runs that do not belong together get one
    # mismatched_runs finding, never a verdict; runs that do are compared under common layer names.
    if (mismatch := check_pairing(fp8, control)) is not None:
        return mismatched_diagnosis(fp8, control, mismatch)
    fp8, control = align_runs(fp8, control)
    cfg = config or DiagnosisConfig()
    ev = gather_evidence(fp8, control, cfg, loss_key)
    findings: list[Finding] = []
    for kind in RULES:  # the path's order (KINDS; mismatched_runs is decided before the rules)
        findings.extend(RULES[kind](ev, tuple(findings)))
    findings.sort(key=finding_order)
    steps = sorted({int(r.step) for r in ev.fp8_rows})
    window = (steps[0], steps[-1]) if steps else None
    return Diagnosis(
        fp8.source, control.source, tuple(findings), ev.ranking, window, ev.loss,
        ev.fp8_spikes, tuple(ev.control_base.spikes), ev.evals,
    )


def mismatched_diagnosis(fp8: RunData, control: RunData, mismatch: Mismatch) -> Diagnosis:
    """The diagnosis of two runs that cannot be compared: one ``mismatched_runs`` finding carrying
    the mismatch's one line, no ranking, no loss comparison."""
    empty = GapJudgement("control_noise", (), (), (), (), (), math.nan, math.nan, False, None, None,
                         math.nan, math.nan, math.nan, "none", 0)
    finding = Finding(
        "mismatched_runs",
        "high",
        0.99,
        "The FP8 run and the control cannot be compared",
        mismatch.message,
        evidence={"mismatch": mismatch.kind},
        next_experiments=(
            "pass the FP8 run and its BF16 control: the same model, data and steps, the control in BF16",
        ),
    )
    return Diagnosis(fp8.source, control.source, (finding,), (), None, empty)


def _loss_spacing(loss: GapJudgement) -> int:
    return max(1, int(np.median(np.diff(loss.steps)))) if len(loss.steps) > 1 else 1


def _row_spacing(rows: Sequence[Any]) -> int | None:
    steps = sorted({int(r.step) for r in rows})
    if len(steps) < 2:
        return None
    return max(1, int(np.median(np.diff(steps))))


__all__ = [
    "KINDS",
    "RULES",
    "DiagnosisConfig",
    "Finding",
    "Diagnosis",
    "Evidence",
    "diagnose",
    "gather_evidence",
    "mismatched_diagnosis",
    "compare_loss",
    "compare_evals",
    "newly_enabled",
    "relative_noise",
    "confidence",
]
