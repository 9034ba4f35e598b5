"""The diagnosis run: :data:`RULES` (one function per finding kind, in the path's order), the
findings' order, :func:`diagnose`."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from fp8track.analysis.baseline import RunData
from fp8track.analysis.damage import judged_steps
from fp8track.analysis.diagnose.evidence import (
    Evidence,
    gather_evidence,
)
from fp8track.analysis.diagnose.model import (
    KINDS,
    SEVERITIES,
    Diagnosis,
    DiagnosisConfig,
    Finding,
)
from fp8track.analysis.diagnose.rules_damage import rule_latent_damage
from fp8track.analysis.diagnose.rules_layers import (
    rule_healthy,
    rule_layer_outlier,
)
from fp8track.analysis.diagnose.rules_loss import (
    rule_divergence_from_start,
    rule_downstream_drop,
    rule_fp8_only_spikes,
    rule_mid_training_gap,
    rule_shared_spikes,
)
from fp8track.analysis.diagnose.rules_moe import rule_expert_outlier, rule_router_divergence
from fp8track.analysis.loss_gap import GapConfig, GapJudgement
from fp8track.analysis.pairing import Mismatch, align_runs, check_pairing
from fp8track.analysis.verdict import Verdict, judge

Rule = Callable[[Evidence, Sequence[Finding]], list[Finding]]

RULES: Mapping[str, Rule] = {
    "shared_spikes": rule_shared_spikes,
    "fp8_only_spikes": rule_fp8_only_spikes,
    "divergence_from_start": rule_divergence_from_start,
    "mid_training_gap": rule_mid_training_gap,
    "downstream_drop_with_normal_loss": rule_downstream_drop,
    "router_divergence": rule_router_divergence,
    "expert_outlier": rule_expert_outlier,
    "layer_outlier": rule_layer_outlier,
    "latent_damage": rule_latent_damage,
    "healthy": rule_healthy,
}
"""One rule per finding kind, run in :data:`KINDS` order; each sees the findings of the rules
before it (``layer_outlier`` asks whether the loss showed trouble, ``latent_damage`` which layers
an outlier finding already reports, ``healthy`` whether anything FP8 caused was found)."""


SYMPTOM_KINDS = tuple(
    k for k in KINDS
    if k not in ("mismatched_runs", "shared_spikes", "expert_outlier", "layer_outlier", "latent_damage",
                 "healthy")
)
"""The path's FP8 failure kinds, read from the loss and evaluation curves: what is wrong with the run."""


def finding_order(f: Finding) -> tuple[int, int, int]:
    """Sort key of the findings: the ``healthy`` finding first (it exists only when nothing FP8
    caused was found: the others are notes under it); then a symptom of medium or high severity
    (what is wrong: spikes, a gap, an evaluation drop), then by severity and the path's order. A
    layer outlier says *where* to look; it is raised only with loss or evaluation trouble, so it
    follows the symptom it explains rather than hiding it (two high layer outliers above a medium
    FP8-only spike read as "no spike"). A layer outlier that broke on its own after the lasting gap
    opened (``breaks_after_gap``) is a separate problem, not an explanation, and so is a destroyed
    layer's latent damage: they compete with the symptoms on severity."""
    if f.kind == "healthy":
        return -1, 0, 0
    symptom_first = 0 if f.kind in SYMPTOM_KINDS and f.severity in ("high", "medium") else 1
    if f.kind == "layer_outlier" and f.evidence.get("breaks_after_gap") or f.kind == "latent_damage":
        # Not explained by the symptoms (or not seen by them): its own severity decides.
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
    judged, warm_up = judged_steps(ev.fp8_rows)
    verdict = judge(findings, len(ev.loss.steps), len(judged), bool(ev.control_rows),
                    extra_notes=control_only_spikes(ev), warm_up_steps=warm_up,
                    control_failed=control_went_wrong(ev))
    return Diagnosis(
        fp8.source, control.source, tuple(findings), ev.ranking, window, ev.loss,
        ev.fp8_spikes, tuple(ev.control_base.spikes), ev.evals, verdict, ev.order.roles,
    )


def _control_alone(ev: Evidence) -> list[int]:
    """Start steps of the control's spikes that the FP8 run does not share."""
    fp8_starts = [e.start_step for e, _ in ev.shared_spikes]
    return [e.start_step for e in ev.control_base.spikes if e.kind == "spike"
            and all(abs(e.start_step - s) > ev.cfg.classify_window for s in fp8_starts)]


def control_went_wrong(ev: Evidence) -> str | None:
    """Why the control cannot vouch for the FP8 run, or ``None``: it spiked where the FP8 run did
    not and its loss ends above the FP8 run's by more than the seed band (``GapJudgement.end_level``,
    the median relative gap where the runs end, below ``-seed_band``). Healthy pairs end within that
    band of each other (``GapConfig.seed_band``); beyond it, after a spike of its own, the control
    diverged (a learning rate or an instability of its own) and "FP8 tracks the control" says
    nothing."""
    alone = _control_alone(ev)
    end = ev.loss.end_level
    if not alone or math.isnan(end):
        return None
    band = ev.loss.seed_band or GapConfig().seed_band
    if end >= -band:
        return None
    return (f"the BF16 control went wrong on its own: it spiked at step {alone[0]} where the FP8 run did "
            f"not, and its loss ends {100 * -end:.1f}% above the FP8 run's (healthy pairs end within "
            f"{100 * band:.0f}%): it cannot vouch for the FP8 run; rerun the control")


def control_only_spikes(ev: Evidence) -> tuple[str, ...]:
    """A note for spikes of the control that the FP8 run does not share (a noisy control, not an
    FP8 problem)."""
    alone = _control_alone(ev)
    if not alone:
        return ()
    return (f"the BF16 control spiked at step(s) {', '.join(map(str, alone))} where the FP8 run did not "
            "(a noisy control, not an FP8 problem)",)


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
    verdict = Verdict("inconclusive", f"the two runs do not belong together: {mismatch.message}")
    return Diagnosis(fp8.source, control.source, (finding,), (), None, empty, verdict=verdict)
