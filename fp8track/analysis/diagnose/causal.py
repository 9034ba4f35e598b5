"""The diagnosis's one layer order: cause before consequence, destroyed layers, the layers named.

Every finding, the ranking in ``diagnosis.json``, the report's headline and the console line read
the :class:`LayerOrder` built here once (:func:`order_layers`), so no two of them can disagree:

* the anomalous layers are the material outliers of the ranking (a score of at least
  ``outlier_min_score`` and an error worse than comparable tensors' by an amount that matters,
  :func:`fp8track.analysis.ranking.material`) and the layers whose FP8 tensors were destroyed on
  some sampled step (:func:`fp8track.analysis.damage.destroyed_layers`);
* the loss's departure from the control (:func:`departure`) is the reference: anomalies that
  started after it, by more than the onsets' resolution, are consequences downstream of the
  earliest anomaly (:func:`fp8track.analysis.causality.causal_order`);
* the layers a numerics finding names are the candidate causes, never a consequence, and, for a
  lasting gap, never a layer that broke on its own after the gap opened (``later``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fp8track.analysis.causality import CAUSE, CONSEQUENCE, Role, causal_order
from fp8track.analysis.damage import Destroyed, destroyed_layers
from fp8track.analysis.loss_gap import GapJudgement
from fp8track.analysis.ranking import LayerRisk, material
from fp8track.analysis.spikes import SpikeEvent


@dataclass(frozen=True)
class LayerOrder:
    """The layers in causal order and what the findings name.

    Attributes:
        ranking: every layer, candidate causes first (destroyed ones first), then the layers
            without anomaly, then the consequences; ranks renumbered.
        outs: the ranking's outliers, in that order.
        roles: per anomalous layer, its :class:`fp8track.analysis.causality.Role`.
        destroyed: the FP8 run's destroyed layer tensors, earliest onset first.
        reference: the loss's departure step (:func:`departure`), or ``None``.
        resolution: steps within which two onsets cannot be ordered.
        named: the layers a numerics finding names, causal first.
        later: candidate causes that broke on their own after a lasting gap opened (they cannot
            explain it).
    """

    ranking: tuple[LayerRisk, ...]
    outs: tuple[LayerRisk, ...]
    roles: Mapping[str, Role] = field(default_factory=dict)
    destroyed: tuple[Destroyed, ...] = ()
    reference: int | None = None
    resolution: int = 0
    named: tuple[str, ...] = ()
    later: frozenset[str] = frozenset()

    def role(self, layer: str) -> Role | None:
        return self.roles.get(layer)

    def is_consequence(self, layer: str) -> bool:
        role = self.roles.get(layer)
        return role is not None and role.role == CONSEQUENCE

    def destroyed_of(self, layer: str) -> list[Destroyed]:
        return [d for d in self.destroyed if d.layer == layer]

    def causal_layer(self) -> str | None:
        """The first candidate cause of the order, or ``None`` when no layer is anomalous."""
        return next((r.layer for r in self.ranking if (role := self.roles.get(r.layer)) is not None
                     and role.role == CAUSE), None)


def departure(loss: GapJudgement, only_spikes: Sequence[SpikeEvent]) -> int | None:
    """The step the FP8 loss departed from the control: the lasting gap's onset, else the onset of
    a gap that ended inside the seed band, else the first FP8-only spike's start; ``None`` when the
    loss never departed."""
    if loss.onset_step is not None:
        return loss.onset_step
    if loss.band_onset_step is not None:
        return loss.band_onset_step
    return min((e.start_step for e in only_spikes), default=None)


def order_layers(
    ranking: Sequence[LayerRisk],
    outs: Sequence[LayerRisk],
    fp8_rows: Sequence[Any],
    loss: GapJudgement,
    only_spikes: Sequence[SpikeEvent],
    resolution: int,
    min_score: float,
    top_k: int,
) -> LayerOrder:
    """The :class:`LayerOrder` of a diagnosis (module docstring).

    Args:
        ranking: the layer ranking by score (:func:`fp8track.analysis.ranking.rank_layers`).
        outs: its outliers (:func:`fp8track.analysis.ranking.outliers`).
        fp8_rows: the FP8 run's tensor-statistics rows (destroyed tensors: ``actual`` rows only).
        loss: the loss judgement; ``only_spikes`` the FP8-only spikes.
        resolution: steps within which two onsets cannot be ordered (the gap's smoothing width
            plus one sampling interval).
        min_score: a layer scoring less is not anomalous, whatever its margin.
        top_k: how many layers a finding names at most.
    """
    destroyed = tuple(d for d in destroyed_layers(fp8_rows) if any(r.layer == d.layer for r in ranking))
    onsets: dict[str, int] = {}
    # A one-step clip (delayed scaling's lag behind an amax jump, Destroyed.lag_only) is a note of
    # its own (rules_damage), never the first destroyed layer that later damage is "downstream" of.
    for d in (d for d in destroyed if not d.lag_only):
        onsets[d.layer] = min(onsets.get(d.layer, d.onset), d.onset)
    steps = [int(r.step) for r in fp8_rows]
    reference = departure(loss, only_spikes)
    anomalous = {r.layer for r in ranking if r.score >= min_score and material(r)}
    ordered, roles = causal_order(ranking, reference, resolution, first_step=min(steps, default=0),
                                  min_score=min_score, destroyed_onsets=onsets, anomalous=anomalous)
    out_set = {r.layer for r in outs}
    outs_ordered = tuple(r for r in ordered if r.layer in out_set)
    later = frozenset(
        layer for layer, role in roles.items()
        if role.role == CAUSE and loss.onset_step is not None and role.onset > loss.onset_step + resolution
    )
    causes = [r for r in ordered if not _consequence(roles, r.layer) and r.layer not in later]
    flagged = out_set | set(onsets)
    # Without a flagged layer, the top-ranked ones are named only when they score as anomalous
    # (min_score): a layer that does not stand out at all is no suspect, and a finding (and the
    # verdict's headline) then names none rather than the best of a flat ranking.
    scored = [r for r in causes if r.score >= min_score]
    first = [r.layer for r in scored if r.rank == scored[0].rank] if scored else []
    named = tuple(
        [r.layer for r in causes if r.layer in flagged][:top_k]
        or [r.layer for r in scored][: max(top_k, len(first))]
    )
    return LayerOrder(tuple(ordered), outs_ordered, roles, destroyed, reference, resolution, named, later)


def _consequence(roles: Mapping[str, Role], layer: str) -> bool:
    role = roles.get(layer)
    return role is not None and role.role == CONSEQUENCE


__all__ = ["LayerOrder", "departure", "order_layers"]
