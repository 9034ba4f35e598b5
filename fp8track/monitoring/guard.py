"""The checkpoint guard: whether training must stop before a checkpoint of the current step is
written (``on_nonfinite`` / ``on_divergence`` of :class:`~fp8track.monitoring.capture_config.CaptureConfig`).

Two moments decide: each flush (:meth:`CheckpointGuard.after_flush`, from the reduced losses and
grad norms and the analyzers' events, no extra device wait) and a checkpoint save
(:meth:`CheckpointGuard.check`, which also looks at the losses not yet flushed and the parameters:
one device wait, as the save waits anyway). The decision is this rank's; the frontends act on it
(the Lightning callback raises ``TrainingHalted``). docs/monitoring.md, "The checkpoint guard".
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from fp8track.monitoring.records import EventRecord
from fp8track.monitoring.reduce import PendingStep
from fp8track.monitoring.sharding import is_dtensor

NO_SCALER_HINT = (
    "; the loss was finite: if a torch.amp.GradScaler skipped this step (fp16), pass it to the "
    "monitor (Monitor(..., grad_scaler=scaler)) so its skipped steps are scaler_skip events, not halts"
)
"""Appended to a non-finite grad norm's halt reason when no loss scaler is watched: the halt an
unwatched fp16 scaler's first skip causes on a healthy run otherwise names no way out."""


class CheckpointGuard:
    """Holds the first reason to stop (:attr:`reason`) and the ``halt`` event announcing it.

    Args:
        on_nonfinite: ``"stop"``: a non-finite loss, gradient norm (of a step the loss scaler did
            not skip) or parameter, or a collapsing loss scale stops training; ``"log"``: no.
        on_divergence: ``"stop"``: a ``divergence`` event stops training; ``"log"``: no.
    """

    def __init__(self, on_nonfinite: str, on_divergence: str) -> None:
        self.on_nonfinite = on_nonfinite
        self.on_divergence = on_divergence
        self.reason: str | None = None
        self._events: list[EventRecord] = []  # halt events not yet written

    def after_flush(
        self,
        step: int,
        pending: Sequence[PendingStep],
        losses: Sequence[float],
        gnorms: Sequence[float],
        events: Sequence[EventRecord],
        scale_collapse: str | None = None,
    ) -> list[EventRecord]:
        """Judge a flush (its pending steps' reduced losses and grad norms, the analyzers'
        events, a loss-scale collapse the scaler's watch found); returns the ``halt`` events to
        write at ``step`` (also one :meth:`check` found). The steps a loss scaler skipped come
        without grad norm (:func:`fp8track.monitoring.grad_scaler.without_skipped`)."""
        reason = self._halt_for(pending, losses, gnorms, events)
        if reason is None and scale_collapse is not None and self.on_nonfinite == "stop":
            reason = scale_collapse
        if reason is not None and self.reason is None:
            self._halt(step, reason)
        out, self._events = self._events, []
        return out

    def check(
        self, pending: Sequence[PendingStep], model: nn.Module, step: int, parameters: bool = True
    ) -> str | None:
        """The guard before a checkpoint save: :attr:`reason`, or with ``on_nonfinite="stop"`` the
        first buffered non-finite loss, or (``parameters``) the parameters holding NaN or inf (a
        non-finite gradient on an unsampled step poisons the weights before any loss shows it)."""
        if self.reason is None and self.on_nonfinite == "stop":
            bad = first_nonfinite_pending(pending)
            if bad is not None:  # the halt event at the step whose loss it names
                self._halt(bad[0], bad[1])
            elif parameters and (reason := nonfinite_parameters(model)) is not None:
                self._halt(step, reason)
        return self.reason

    def _halt(self, step: int, reason: str) -> None:
        self.reason = reason
        self._events.append(EventRecord("halt", step, {"reason": reason}))

    def _halt_for(
        self,
        pending: Sequence[PendingStep],
        losses: Sequence[float],
        gnorms: Sequence[float],
        events: Sequence[EventRecord],
    ) -> str | None:
        """Why training must stop after this flush, or None."""
        if self.on_nonfinite == "stop":
            for p, loss, g in zip(pending, losses, gnorms, strict=True):
                if p.loss is not None and not math.isfinite(loss):
                    return f"non-finite loss ({loss}) at step {p.step}"
                if p.grad_norm is not None and not math.isfinite(g):
                    return f"non-finite gradient norm ({g}) at step {p.step}" + (
                        NO_SCALER_HINT if p.scale is None and math.isfinite(loss) else "")
        if self.on_divergence == "stop":
            for e in events:
                if e.kind == "divergence":
                    return f"divergence detected at step {e.step} ({e.data.get('reason', 'loss rising')})"
        return None


def first_nonfinite_pending(pending: Sequence[PendingStep]) -> tuple[int, str] | None:
    """The first buffered step whose loss is non-finite and the halt reason (one device wait), or None."""
    given = [p for p in pending if p.loss is not None]
    if not given:
        return None
    ok = torch.isfinite(torch.stack([p.loss.to(given[0].loss.device) for p in given])).tolist()  # type: ignore[union-attr]
    for p, fine in zip(given, ok, strict=True):
        if not fine:
            return p.step, f"non-finite loss ({float(p.loss)}) at step {p.step}"  # type: ignore[arg-type]
    return None


def nonfinite_parameters(model: nn.Module) -> str | None:
    """Names the parameters holding NaN or inf (one device wait), or None when all are finite."""
    named = [(n, p) for n, p in model.named_parameters() if p.is_floating_point() and p.numel()]
    if not named:
        return None
    norms = torch._foreach_norm([(p.to_local() if is_dtensor(p) else p).detach() for _, p in named])
    flags = torch.stack([torch.isfinite(v.to(norms[0].device)) for v in norms]).tolist()
    bad = [n for (n, _), fine in zip(named, flags, strict=True) if not fine]
    if not bad:
        return None
    return f"non-finite parameters after step: {', '.join(bad[:4])}" + (" ..." if len(bad) > 4 else "")
