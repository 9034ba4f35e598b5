"""The evidence every rule reads, computed once per diagnosis (:class:`Evidence`,
:func:`gather_evidence`): the loss and evaluation comparisons, spikes, rows, the layer ranking."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from fp8track.analysis.baseline import Baseline, RunData, classify_spike
from fp8track.analysis.causes import known_causes
from fp8track.analysis.diagnose.causal import LayerOrder, order_layers
from fp8track.analysis.diagnose.model import (
    LOWER_IS_BETTER,
    DiagnosisConfig,
)
from fp8track.analysis.layer_history import HistoryShift, history_shifts
from fp8track.analysis.loss_gap import GapConfig, GapJudgement, judge_gap, same_batches, step_noise
from fp8track.analysis.ranking import LayerRisk, outliers, rank_layers
from fp8track.analysis.spike_events import SpikeClassification
from fp8track.analysis.spikes import SpikeConfig, SpikeEvent, detect_spikes
from fp8track.monitoring.records import TensorStatsRow


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
        ranking: the layer ranking (:func:`fp8track.analysis.ranking.rank_layers`, against the
            control) in causal order (:mod:`fp8track.analysis.diagnose.causal`): candidate causes
            first, consequences last. Every rule and view reads this one order.
        outs: its outliers, in that order.
        named: the layers a numerics finding names: the candidate causes among the outliers and
            destroyed layers, else the top-ranked causes (with ties); never a consequence.
        model_order: the FP8 run's layers in model order (FP8 layers, then BF16 ones).
        evals: per evaluation metric, :func:`compare_evals`.
        row_spacing: steps between two sampled steps of the tensor statistics.
        causes: the known causes the run points to (:func:`fp8track.analysis.causes.known_causes`).
        paired_spikes: spikes of the FP8/control loss ratio when both runs saw the same batches
            (:func:`paired_spikes`); empty otherwise.
        order: the causal order behind ``ranking``, ``outs`` and ``named``: roles (cause or
            consequence, onsets), destroyed layer tensors, the loss's departure step.
        shared_spikes, only_spikes: the FP8 spikes shared with the control and the FP8-only ones,
            each ``(event, classification or None)`` (:func:`classify_spikes`).
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
    order: LayerOrder = field(default_factory=lambda: LayerOrder((), ()))
    shared_spikes: tuple[tuple[SpikeEvent, Any], ...] = ()
    only_spikes: tuple[tuple[SpikeEvent, Any], ...] = ()

    @property
    def resolution(self) -> int:
        """Steps within which two onsets cannot be ordered: the gap's smoothing width plus one
        statistics sampling interval."""
        return self.loss.smooth * _loss_spacing(self.loss) + self.row_spacing

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
    (the gap's smoothing width plus one sampling interval) and no earlier than twice that
    resolution before it; ``None`` when no outlier did (the gap stays no finding)."""
    if loss.band_onset_step is None:
        return None
    res = loss.smooth * loss_spacing + row_spacing
    for r in outs:
        if r.onset is not None and loss.band_onset_step - 2 * res <= r.onset <= loss.band_onset_step + res:
            return r.layer
    return None


def fp8_layer_rows(rows: Sequence[TensorStatsRow]) -> list[TensorStatsRow]:
    """The rows of the layers that ran in FP8: without the ``shadow`` rows of the FP8 run's BF16
    layers (``bf16_layers`` fallbacks: what FP8 would do to them). They did not run in FP8, so
    nothing the FP8 run shows can be theirs, and the diagnosis never names them (a Llama with
    ``first_last`` named a BF16 layer of block 0 its top-ranked layer). A run without ``actual``
    rows keeps them all (nothing else to rank)."""
    if not any(r.variant == "actual" for r in rows):
        return list(rows)
    return [r for r in rows if r.variant != "shadow"]


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
        rank_layers(fp8_layer_rows(fp8_rows), control=ctl_rows or None, events=fp8.events,
                    history_z=cfg.history_z)
    )
    outs = tuple(outliers(ranking, cfg.outlier_z, cfg.outlier_min_score))
    row_spacing = _row_spacing(fp8_rows) or spacing
    if (cause := corroborating_break(outs, loss, spacing, row_spacing)) is not None:
        # The seed band is there because one pair cannot tell drift from damage; a layer that broke
        # on its own just before the gap opened tells them apart: the gap is judged without it.
        loss = replace(compare_loss(fl, cl, cfg, paired=loss.unit == "paired", seed_band=0.0),
                       corroborated_by=cause)
    paired = paired_spikes(fl, cl, steps, scfg) if loss.unit == "paired" else ()
    shared, only = classify_spikes(loss, tuple(fp8_spikes), ctl_base, paired, cfg.classify_window,
                                   {s: fl[s] for s in steps})
    # One order for every rule and view: cause before consequence (diagnose.causal).
    order = order_layers(ranking, outs, fp8_rows, loss, [e for e, _ in only],
                         loss.smooth * spacing + row_spacing, cfg.outlier_min_score, cfg.top_k)
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
        order.ranking,
        order.outs,
        order.named,
        model_order,
        evals,
        row_spacing,
        known_causes(fp8.meta, fp8_rows),
        paired,
        order,
        tuple(shared),
        tuple(only),
    )


def classify_spikes(
    loss: GapJudgement, fp8_spikes: Sequence[SpikeEvent], control: Baseline,
    paired: Sequence[SpikeEvent], classify_window: int, fp8_loss: Mapping[int, float] | None = None,
) -> tuple[list[tuple[SpikeEvent, Any]], list[tuple[SpikeEvent, Any]]]:
    """FP8 spikes split into (shared with the control, FP8 only), each as ``(event, classification)``
    (:func:`fp8track.analysis.baseline.classify_spike`; ``None`` for an excursion of the paired ratio).
    An FP8 spike that never recovers and starts within one smoothing window of a lasting gap's onset
    is that gap's own step up, judged by the gap rules; excursions of the paired ratio that the raw
    loss's noise hid are FP8-only (the data cancels in the ratio). An FP8 spike the control's
    detector did not match is shared all the same when the control's loss (``control.loss``) rose
    alike over the same steps (:func:`control_rose_alike`, given ``fp8_loss``)."""
    shared: list[tuple[SpikeEvent, Any]] = []
    only: list[tuple[SpikeEvent, Any]] = []
    spacing = _loss_spacing(loss)

    def gap_step_up(e: SpikeEvent) -> bool:
        return (loss.onset_step is not None and e.status == "not_recovered"
                and e.start_step >= loss.onset_step - loss.smooth * spacing)

    for e in fp8_spikes:
        if e.kind == "spike" and not gap_step_up(e):
            cls = classify_spike(e, control, classify_window)
            alike = fp8_loss is not None and control_rose_alike(e, fp8_loss, control.loss)
            if cls.label != "shared" and alike:
                # The control's detector did not fire, but its loss took the same excursion at the
                # same steps (a borderline spike detected on one side only): not FP8's doing.
                cls = SpikeClassification("shared", classify_window, control_start_step=e.start_step,
                                          step_offset=0, recover_steps=e.recover_steps)
            (shared if cls.label == "shared" else only).append((e, cls))
    seen = [e.start_step for e, _ in shared + only]
    for e in paired:
        if not gap_step_up(e) and all(abs(e.start_step - s) > classify_window for s in seen):
            only.append((e, None))
    only.sort(key=lambda ec: ec[0].start_step)
    return shared, only


CONTROL_ALIKE = 0.5
"""An FP8 spike the control's detector missed is still shared when the control's loss rose over the
same steps by at least this share of the FP8 run's rise (:func:`control_rose_alike`)."""


def control_rose_alike(e: SpikeEvent, fp8: Mapping[int, float], control: Mapping[int, float],
                       before: int = 5) -> bool:
    """Whether the control's loss rose like the FP8 spike ``e`` at the same steps: each run's rise
    from the median of its own ``before`` steps before ``e`` starts to its largest value over
    ``e``'s start..peak (one step either side), the control's at least :data:`CONTROL_ALIKE` of the
    FP8 run's. Both runs see the batch at a step, so a batch that spikes both losses is shared even
    when the control's spike detector, a thresholded event, missed its copy of it by a hair."""

    def rise(series: Mapping[int, float]) -> float:
        pre = [float(series[s]) for s in sorted(series) if e.start_step - before <= s < e.start_step
               and math.isfinite(float(series[s]))]
        span = [float(series[s]) for s in sorted(series) if e.start_step - 1 <= s <= e.peak_step + 1
                and math.isfinite(float(series[s]))]
        if not pre or not span:
            return math.nan
        return max(span) - float(np.median(pre))

    mine, theirs = rise(fp8), rise(control)
    return math.isfinite(mine) and mine > 0 and math.isfinite(theirs) and theirs >= CONTROL_ALIKE * mine


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


def _loss_spacing(loss: GapJudgement) -> int:
    return max(1, int(np.median(np.diff(loss.steps)))) if len(loss.steps) > 1 else 1


def _row_spacing(rows: Sequence[Any]) -> int | None:
    steps = sorted({int(r.step) for r in rows})
    if len(steps) < 2:
        return None
    return max(1, int(np.median(np.diff(steps))))
