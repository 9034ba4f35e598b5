"""Cause before consequence: the layer ranking ordered by when each anomaly started.

Damage propagates: a layer whose FP8 output is wrong feeds wrong activations to the layers after
it, the loss rises, and the gradients of the head change with it. Those later anomalies are real,
and often larger than the first one (a head whose gradient underflows once the loss blew up), so a
ranking by size alone can headline the consequence. The order here uses time:

* an anomalous layer (one the caller names, by default one the ranking scores at least
  ``min_score``, or one whose tensors were destroyed, :mod:`fp8track.analysis.damage`) has an
  **onset**: the start of its own-history window
  (``LayerRisk.onset``; ``None``, anomalous from its first sampled step, counts as the run's start)
  or its first destroyed step, whichever is earlier;
* the **reference** is the loss's departure from the control (the gap's onset, or the first
  FP8-only spike) when there is one, else the earliest anomalous onset;
* a layer whose onset is later than the reference by more than the onsets' ``resolution`` (the
  gap's smoothing width plus one sampling interval) is a **consequence**, "downstream of" the
  earliest anomalous layer; the others are **candidate causes**. The reference is never earlier
  than the earliest anomalous onset: a layer that broke after a departure no layer explains is
  not downstream of anything (it is a cause of its own, later problem).

:func:`causal_order` returns the ranking with the candidate causes first (destroyed layers before
the others: their evidence needs no comparison; then by score), then the layers without anomaly,
then the consequences, and the role of each anomalous layer; every finding, the report's headline
and the console line read this one order.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

from fp8track.analysis.ranking import LayerRisk

CAUSE, CONSEQUENCE = "cause", "consequence"


@dataclass(frozen=True)
class Role:
    """One anomalous layer's place in time.

    Attributes:
        layer: the layer.
        role: :data:`CAUSE` or :data:`CONSEQUENCE`.
        onset: the step its anomaly started (the run's first step when it was anomalous from the start).
        downstream_of: for a consequence, the earliest anomalous layer.
        reason: one line, with the steps.
    """

    layer: str
    role: str
    onset: int
    downstream_of: str | None = None
    reason: str = ""


def causal_order(
    ranking: Sequence[LayerRisk],
    reference: int | None,
    resolution: int,
    first_step: int = 0,
    min_score: float = 3.0,
    destroyed_onsets: Mapping[str, int] | None = None,
    anomalous: Collection[str] | None = None,
) -> tuple[list[LayerRisk], dict[str, Role]]:
    """``(reordered ranking, {layer: Role})`` (see the module docstring).

    Args:
        ranking: the layer ranking, riskiest first.
        reference: the step the loss departed from the control, or ``None``.
        resolution: steps within which two onsets cannot be ordered.
        first_step: the run's first sampled step (the onset of a layer anomalous from the start).
        min_score: the score from which a layer is anomalous.
        destroyed_onsets: ``{layer: first destroyed step}`` (those layers are anomalous whatever
            their score).
        anomalous: the layers that count as anomalous besides the destroyed ones (default: those
            scoring at least ``min_score``).
    """
    destroyed = dict(destroyed_onsets or {})
    onsets: dict[str, int] = {}
    for r in ranking:
        flagged = r.score >= min_score if anomalous is None else r.layer in anomalous
        if flagged or r.layer in destroyed:
            own = r.onset if r.onset is not None else first_step
            onsets[r.layer] = min(own, destroyed.get(r.layer, own))
    for layer, step in destroyed.items():
        onsets.setdefault(layer, step)
    if not onsets:
        return list(ranking), {}
    earliest = min(onsets.values())
    first_layer = min(onsets, key=lambda n: (onsets[n], -_score(ranking, n)))
    ref = reference if reference is not None else earliest
    cut = max(ref, earliest) + resolution
    # A destroyed layer is downstream only of an earlier destroyed layer: a statistical anomaly
    # elsewhere (drift, a z-score) cannot wreck a GEMM's output, so it never demotes one.
    # Destroyed layers are ordered by their first destroyed step, never by a statistical window
    # that starts at the run's first step (``onset None``): two layers destroyed on the same step
    # are both candidate causes, whatever their windows.
    first_wrecked = min(destroyed, key=lambda n: (destroyed[n], -_score(ranking, n))) if destroyed else None
    roles = {}
    for layer, onset in onsets.items():
        if layer in destroyed and first_wrecked is not None:
            wrecked_cut = max(ref, destroyed[first_wrecked]) + resolution
            if layer != first_wrecked and destroyed[layer] > wrecked_cut:
                roles[layer] = Role(layer, CONSEQUENCE, onset, first_wrecked,
                                    f"destroyed from step {destroyed[layer]}, more than {resolution} steps "
                                    f"after {first_wrecked} was destroyed (step {destroyed[first_wrecked]}): "
                                    f"downstream of {first_wrecked}")
            else:
                roles[layer] = Role(layer, CAUSE, onset, None,
                                    f"destroyed from step {destroyed[layer]}; no layer was destroyed "
                                    f"more than {resolution} steps before it")
            continue
        if onset > cut:
            after = (f"the loss departed from the control at step {reference}"
                     if reference is not None else f"{first_layer}'s anomaly at step {onsets[first_layer]}")
            roles[layer] = Role(layer, CONSEQUENCE, onset, first_layer,
                                f"its anomaly started at step {onset}, more than {resolution} steps after "
                                f"{after}: downstream of {first_layer}")
        else:
            before = (f"no later than the loss's departure at step {reference}" if reference is not None
                      else "first among the anomalous layers")
            roles[layer] = Role(layer, CAUSE, onset, None, f"its anomaly started at step {onset}, {before}")
    rank_of = {r.layer: i for i, r in enumerate(ranking)}
    tier = {CAUSE: 0, CONSEQUENCE: 2}

    def key(r: LayerRisk) -> tuple[int, int, int]:
        role = roles.get(r.layer)
        lost = int(not (role and role.role == CAUSE and r.layer in destroyed))
        return (tier[role.role] if role else 1, lost, rank_of[r.layer])

    ordered = sorted(ranking, key=key)
    return _reranked(ordered), roles


def _score(ranking: Sequence[LayerRisk], layer: str) -> float:
    return next((r.score for r in ranking if r.layer == layer), 0.0)


def _reranked(ordered: Sequence[LayerRisk]) -> list[LayerRisk]:
    """``rank`` renumbered in the new order (ties keep a shared rank only while adjacent)."""
    out: list[LayerRisk] = []
    for i, r in enumerate(ordered):
        prev = out[-1] if out else None
        same = prev is not None and r.layer in prev.tied and prev.layer in r.tied
        out.append(replace(r, rank=prev.rank if same and prev else i + 1))
    return out
