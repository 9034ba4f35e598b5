"""The loss scaler's side of the checkpoint guard: which steps ``torch.amp.GradScaler`` skipped, and
whether its scale is collapsing.

Under fp16 mixed precision the scaler multiplies the loss by a large scale before the backward; a
step whose scaled gradients overflow holds inf/NaN gradients, and the scaler then skips the
optimizer step (the weights stay untouched) and lowers the scale (``scale * backoff_factor``). Such
a step is the scaler doing its job, not poison: it is recorded as a ``scaler_skip`` event, never a
halt, and its gradient norm (of overflowed gradients) is neither a metric nor a spike.

A skip is read from the scale alone, as Hugging Face Accelerate does (``scale_after < scale_before``
in ``accelerator.optimizer_step_was_skipped``): the scale falls only at a step that found inf
(``torch._amp_update_scale_``), and ``update()`` runs after every step. The monitor keeps each
step's scale on its device (a clone, no host copy) and reads them all at the next flush.

What the scaler cannot explain still halts: a non-finite *loss* (the scale multiplies the loss
after it is computed, so it never makes the loss itself overflow), non-finite parameters
(:func:`fp8track.monitoring.guard.nonfinite_parameters`), and a scale that skips keep driving
towards 0: below ``min_scale`` (fairseq's ``--min-loss-scale`` default, 1e-4: "Minimum loss scale
reached ... Your loss is probably exploding") the run is making no progress, recorded as a
``scaler_collapse`` event with the scale history.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from fp8track.errors import ConfigError
from fp8track.monitoring.records import EventRecord
from fp8track.monitoring.reduce import PendingStep

DEFAULT_MIN_SCALE = 1e-4
"""A loss scale below this, reached by skips, is a collapse (fairseq's ``min_loss_scale``)."""

HISTORY = 32
"""How many scale changes the ``scaler_collapse`` event carries (the most recent)."""


def check_grad_scaler(scaler: Any) -> Any:
    """``scaler`` if it is a ``torch.amp.GradScaler`` (or a subclass: the CUDA alias, FSDP's
    ``ShardedGradScaler``) or None; else a :class:`ConfigError`."""
    if scaler is None or isinstance(scaler, torch.amp.GradScaler):
        return scaler
    raise ConfigError(
        f"grad_scaler must be a torch.amp.GradScaler (the one your loop calls scale/step/update on) "
        f"or None, got {type(scaler).__name__}"
    )


def current_scale(scaler: Any) -> torch.Tensor | None:
    """The scaler's scale now, as a float32 0-d tensor on its device (a clone: ``update()`` changes
    the scaler's own in place; no host copy), or None when there is no enabled scaler."""
    if scaler is None or not scaler.is_enabled():
        return None
    scale = scaler._get_scale_async()  # the device tensor behind get_scale(), which would sync
    if scale is None:  # not used yet: the scale it will start from
        return torch.tensor(float(scaler._init_scale), dtype=torch.float32)
    scale = scale.detach().reshape(()).to(torch.float32).clone()
    # Called after ``scaler.step(opt)`` but before ``scaler.update()``: the scale has not fallen
    # yet, but the step's inf checks are recorded. The scale ``update()`` will set on a skip is
    # what this step ends with, so the skip is this step's, not the next one's.
    found = [
        f.to(scale.device, torch.float32)
        for state in getattr(scaler, "_per_optimizer_states", {}).values()
        for f in state["found_inf_per_device"].values()
    ]
    if found:
        scale = torch.where(sum(found) > 0, scale * float(scaler._backoff_factor), scale)
    return scale


@dataclass
class ScalerVerdict:
    """What one flush's scales say: the skipped steps, the events to write, a collapse (a halt
    reason) or None."""

    skipped: set[int] = field(default_factory=set)
    events: list[EventRecord] = field(default_factory=list)
    collapse: str | None = None


class ScalerWatch:
    """Reads the scales of the flushed steps (host floats, NaN where no scaler) in step order.

    Args:
        min_scale: a scale that skips drive below this is a collapse (one ``scaler_collapse`` event).
    """

    def __init__(self, min_scale: float = DEFAULT_MIN_SCALE) -> None:
        self.min_scale = min_scale
        self.last: float | None = None  # the scale after the last step read
        self.history: deque[tuple[int, float]] = deque(maxlen=HISTORY)  # (step, scale) at each change
        self.collapsed = False

    def state_dict(self) -> dict[str, Any]:
        return {"last": self.last, "history": [list(h) for h in self.history], "collapsed": self.collapsed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last = state.get("last", self.last)
        self.history = deque(((int(s), float(v)) for s, v in state.get("history", [])), maxlen=HISTORY)
        self.collapsed = bool(state.get("collapsed", self.collapsed))

    def observe(self, pending: Sequence[PendingStep], scales: Sequence[float]) -> ScalerVerdict:
        out = ScalerVerdict()
        for p, scale in zip(pending, scales, strict=True):
            if math.isnan(scale):
                continue
            before, self.last = self.last, scale
            if before is None:
                self.history.append((p.step, scale))
                continue
            if scale != before:
                self.history.append((p.step, scale))
            if scale < before:
                out.skipped.add(p.step)
                data = {"scale": scale, "previous_scale": before}
                out.events.append(EventRecord("scaler_skip", p.step, data))
                if scale < self.min_scale and not self.collapsed:
                    self.collapsed = True
                    out.collapse = (
                        f"loss scale collapsed to {scale:.3g} at step {p.step} (below {self.min_scale:g}: "
                        "the scaler skips step after step, gradients overflow at any scale)"
                    )
                    history = [[s, v] for s, v in self.history]
                    info: dict[str, Any] = {"scale": scale, "min_scale": self.min_scale, "history": history}
                    out.events.append(EventRecord("scaler_collapse", p.step, info))
        return out


def without_skipped(
    pending: Sequence[PendingStep], gnorms: Sequence[float], skipped: set[int]
) -> tuple[list[PendingStep], list[float]]:
    """The pending steps and grad norms with a skipped step's grad norm dropped: the overflowed
    gradients the scaler threw away are no metric, no spike and no reason to halt."""
    if not skipped:
        return list(pending), list(gnorms)
    steps = [replace(p, grad_norm=None) if p.step in skipped else p for p in pending]
    norms = [math.nan if p.step in skipped else g for p, g in zip(pending, gnorms, strict=True)]
    return steps, norms
