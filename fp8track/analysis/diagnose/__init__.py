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

from fp8track.analysis.diagnose.evidence import (
    Evidence,
    compare_evals,
    compare_loss,
    gather_evidence,
    newly_enabled,
    relative_noise,
    spike_config_for,
)
from fp8track.analysis.diagnose.model import (
    KINDS,
    SEVERITIES,
    Diagnosis,
    DiagnosisConfig,
    Finding,
    confidence,
)
from fp8track.analysis.diagnose.run import (
    RULES,
    SYMPTOM_KINDS,
    Rule,
    diagnose,
    finding_order,
    mismatched_diagnosis,
)

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
    "spike_config_for",
    "finding_order",
    "Rule",
    "SEVERITIES",
    "SYMPTOM_KINDS",
]

