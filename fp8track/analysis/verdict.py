"""One verdict per FP8/control pair, first in ``diagnosis.json``, the report and the console.

* ``inconclusive``: the pair cannot support an answer (too few common loss steps, too few sampled
  steps of statistics, no control); the reason says which and what would make it conclusive;
* ``fp8_problem``: a finding FP8 caused (an FP8-only spike, a lasting gap, an evaluation drop with
  normal loss, a layer or expert that stands out while the loss shows trouble, a destroyed layer,
  routing that departs from the control); the verdict names the causal finding and its layer;
* ``healthy``: FP8 is the cause of nothing seen. What is not FP8's doing (spikes both runs share,
  layers to watch without any loss impact) are notes under it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

VERDICTS = ("healthy", "fp8_problem", "inconclusive")
FP8_KINDS = (
    "fp8_only_spikes", "divergence_from_start", "mid_training_gap", "downstream_drop_with_normal_loss",
    "router_divergence", "latent_damage", "expert_outlier", "layer_outlier",
)
"""Finding kinds that say FP8 did something (at medium severity or above)."""
NOTE_KINDS = ("shared_spikes",)
MIN_LOSS_STEPS = 20
MIN_SAMPLED_STEPS = 3


@dataclass(frozen=True)
class Verdict:
    """The pair's verdict.

    Attributes:
        verdict: one of :data:`VERDICTS`.
        reason: one line.
        cause: the causal finding's kind (``fp8_problem``), else ``None``.
        layers: the layers it names, causal first.
        notes: observations that are not FP8's doing.
    """

    verdict: str
    reason: str
    cause: str | None = None
    layers: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "reason": self.reason, "cause": self.cause,
                "layers": list(self.layers), "notes": list(self.notes)}


def judge(findings: Sequence[Any], loss_steps: int, sampled_steps: int, has_control_rows: bool,
          extra_notes: Sequence[str] = (), warm_up_steps: int = 0,
          control_failed: str | None = None) -> Verdict:
    """The verdict of ``findings`` (sorted, causal first), given how much the pair holds;
    ``extra_notes`` are observations that are no finding (a control that spiked alone);
    ``sampled_steps`` counts the steps that show the recipe at work, ``warm_up_steps`` the sampled
    steps left out of it (delayed scaling's initial scale); ``control_failed`` why the control
    cannot vouch for the FP8 run (it went wrong on its own), or ``None``."""
    notes = tuple(f.title for f in findings if f.kind in NOTE_KINDS or (
        f.kind in FP8_KINDS and f.severity in ("low", "info"))) + tuple(extra_notes)
    fp8 = [f for f in findings if f.kind in FP8_KINDS and f.severity in ("high", "medium")]
    if any(f.kind == "mismatched_runs" for f in findings):
        return Verdict("inconclusive", "the two runs do not belong together (see the finding)")
    if fp8:
        top = fp8[0]
        layers = tuple(top.layers) or next((tuple(f.layers) for f in fp8 if f.layers), ())
        where = f" in {layers[0]}" if layers else ""
        return Verdict(
            "fp8_problem",
            f"{top.title}{where}" if where and layers[0] not in top.title else top.title,
            top.kind,
            layers,
            notes,
        )
    if control_failed:
        return Verdict("inconclusive", control_failed, notes=notes)
    if loss_steps < MIN_LOSS_STEPS:
        return Verdict("inconclusive", f"only {loss_steps} common loss steps (at least {MIN_LOSS_STEPS} "
                       "needed to tell a gap from noise): train longer", notes=notes)
    if sampled_steps < MIN_SAMPLED_STEPS:
        return Verdict(
            "inconclusive",
            f"only {sampled_steps} sampled steps of tensor statistics (at least "
            f"{MIN_SAMPLED_STEPS}"
            + (f"; {warm_up_steps} more at delayed scaling's initial scale 1.0 show only its warm-up"
               if warm_up_steps else "")
            + "): sample more often (every_n_steps) or train longer",
            notes=notes,
        )
    if not has_control_rows:
        notes = (*notes, "the control has no tensor statistics: layers were judged against each other only")
    return Verdict("healthy", "FP8 is the cause of nothing seen: the loss tracks the control, no layer or "
                   "expert was destroyed or stands out with a loss impact", notes=notes)
