"""GEMM FLOPs of modules no other capture sees, for the FP8 FLOP share: experts held in a layout
fp8track does not recognise (DBRX's 2-D ``w1``/``v1``/``w2``, JetMoE's parallel experts;
:func:`fp8track.execution.experts.unrecognised_experts`). No backend converts them, so they run in
high precision; without this capture their GEMMs would be missing from the share's denominator and
a DBRX would read 1.0 where most of its FLOPs ran in BF16.

On sampled steps the module's forward runs under ``torch.utils.flop_counter.FlopCounterMode``
(PyTorch's own count: ``2 M N K`` per matmul, whatever the module does inside: loops over experts,
gathers, batched GEMMs), and the step counts three times that (forward, input gradient, weight
gradient), the convention of every other capture. Torch's counter is used rather than a count of our
own because these modules' code is, by definition, code fp8track does not know.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from fp8track.execution.checkpointing import RecomputeFilter
from fp8track.monitoring.plans import RowlessCapture

TRAINING_GEMMS = 3
"""GEMMs a training step runs per forward GEMM: the forward, the input gradient, the weight gradient."""


class ModuleFlopsCapture(RowlessCapture):
    """The FLOPs of one module's forward on sampled steps, as a capture with no statistics rows.

    Args:
        name: the capture's key (the module's canonical name).
        module: the module whose forward is counted (its plan is high precision).
    """

    def __init__(self, name: str, module: nn.Module) -> None:
        super().__init__(name)
        self.name = name
        self.module = module
        self._handles: list[Any] = []
        self._counter: FlopCounterMode | None = None
        self._recompute = RecomputeFilter()

    def attach(self) -> None:
        if not self._handles:
            self._handles = [
                self.module.register_forward_pre_hook(self._pre_hook),
                self.module.register_forward_hook(self._post_hook),
            ]

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.active = False

    def begin_step(self, sampled: bool) -> None:
        self.active = sampled
        self._recompute.reset()

    def _counts(self) -> bool:
        """Whether this forward is one of the step's training forwards (not an activation-
        checkpointing recompute of one, not evaluation, not inside a compiled graph, where a
        dispatch mode cannot be entered)."""
        if not (self.active and torch.is_grad_enabled()) or torch.compiler.is_compiling():
            return False
        return not self._recompute.is_recompute()

    def _pre_hook(self, module: nn.Module, args: tuple) -> None:
        if self._counter is None and self._counts():
            self._counter = FlopCounterMode(display=False)
            self._counter.__enter__()

    def _post_hook(self, module: nn.Module, args: tuple, output: object) -> None:
        counter, self._counter = self._counter, None
        if counter is not None:
            counter.__exit__(None, None, None)
            self.flops += TRAINING_GEMMS * int(counter.get_total_flops())
