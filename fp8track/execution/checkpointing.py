"""Activation checkpointing: telling a recompute from the forward it repeats.

``torch.utils.checkpoint`` (and everything built on it: Hugging Face's
``gradient_checkpointing_enable()``, FSDP's checkpoint wrapper) runs a region's forward a second
time during the backward pass. That recompute must repeat the original forward bit for bit and
change no state: Transformer Engine stashes the delayed-scaling scales and amax history before
the first forward of a checkpointed region and swaps them back in for the recompute, which
neither records amaxes nor updates scales
(``FP8GlobalStateManager.copy_forward_fp8_meta_tensors_for_recompute`` /
``get_old_fp8_meta_tensors_for_recompute`` / ``restore_fp8_meta_tensors`` in
``transformer_engine/pytorch/quantization.py``, called from ``TransformerEngineBaseModule.prepare_forward``
and ``end_forward`` in ``module/base.py`` when ``in_fp8_activation_recompute_phase()``, a flag set by
``activation_recompute_forward`` in ``distributed.py``). TE knows the phase because its own
``te.distributed.checkpoint`` sets that flag; ``torch.utils.checkpoint`` sets none, so a recompute
is recognised by where it runs: a forward inside a backward pass.

* Non-reentrant (``use_reentrant=False``): the first forward runs with grad enabled and outside
  backward; the recompute runs inside backward (from a saved tensor's unpack hook).
* Reentrant (``use_reentrant=True``): the first forward runs under ``no_grad`` (inside an autograd
  Function), so it is an inference forward to the layers; the recompute, inside backward with
  grad enabled, is the only forward that builds a graph, and is treated as the step's forward.

Hence the rule both the emulated backend and the monitor follow: a forward inside backward
repeats the oldest forward of the same layer that is still waiting for its backward, if there
is one; otherwise (reentrant) it is the training forward itself.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch


def in_backward() -> bool:
    """Whether the calling code runs inside an autograd backward pass (a graph task).

    ``torch._C._current_graph_task_id()`` is what ``torch.utils.checkpoint`` itself reads to key
    its recomputations (``_checkpoint_hook.unpack_hook``); it is -1 outside backward. Torch builds
    without it answer False (recomputes are then not recognised).
    """
    graph_task_id = getattr(torch._C, "_current_graph_task_id", None)
    return graph_task_id is not None and graph_task_id() != -1


class RecomputeFilter:
    """Tells, within one step, the forwards a hook should observe from activation-checkpointing
    recomputes of forwards already observed (reset it at each step's start).

    A forward that runs inside a backward pass is a recompute. Non-reentrant checkpointing
    (``use_reentrant=False``, Hugging Face's default) first ran the region with grad enabled, so
    that forward was observed: skip the recompute, as many times as forwards were observed.
    Reentrant checkpointing ran it under ``no_grad`` (not observed): its recompute, the only
    forward that builds a graph (and whose dY reaches the hook), is the one observed.
    """

    __slots__ = ("forwards", "recomputes")

    def __init__(self) -> None:
        self.forwards = 0  # training forwards observed this step (outside backward)
        self.recomputes = 0  # forwards run inside backward this step and taken as their recompute

    def reset(self) -> None:
        self.forwards = self.recomputes = 0

    def is_recompute(self) -> bool:
        """Whether the forward now running recomputes one already observed (call once per forward)."""
        if not in_backward():
            self.forwards += 1
            return False
        if self.recomputes < self.forwards:
            self.recomputes += 1
            return True
        return False


class ForwardScales:
    """The delayed-scaling scales one training forward quantised with, kept while its autograd
    graph lives (its Function context holds it), for a recompute to replay."""

    __slots__ = ("__weakref__", "replayed", "scales")

    def __init__(self) -> None:
        self.scales: dict[str, torch.Tensor] = {}
        self.replayed = False


class RecomputeQueue:
    """The forwards of one layer still waiting for their backward (weakly held), and the rule of
    the module docstring: a training forward inside backward replays the oldest of them (first in,
    first out, as TE's ``fp8_tensors_recompute_buffer``) and updates nothing; any other training
    forward gets a fresh :class:`ForwardScales` to fill."""

    def __init__(self) -> None:
        self._waiting: list[weakref.ref[ForwardScales]] = []

    def begin_forward(self) -> tuple[ForwardScales, bool]:
        """``(record, replay)`` for a training forward under delayed scaling."""
        if in_backward():
            for ref in self._waiting:
                rec = ref()
                if rec is not None and not rec.replayed:
                    rec.replayed = True
                    return rec, True
        self._waiting = [r for r in self._waiting if r() is not None]
        rec = ForwardScales()
        self._waiting.append(weakref.ref(rec))
        return rec, False

    def __getstate__(self) -> dict[str, Any]:
        # The waiting forwards belong to this process's autograd graphs (a copy has none) and
        # weak references cannot be pickled: a pickled model (torch.save) waits for nothing.
        return {"_waiting": []}

    def end_backward(self, rec: ForwardScales | None) -> None:
        """The backward of the forward that filled ``rec`` ran: it waits no more."""
        if rec is not None:
            self._waiting = [r for r in self._waiting if r() is not None and r() is not rec]


__all__ = ["in_backward", "ForwardScales", "RecomputeQueue"]
