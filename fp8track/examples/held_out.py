"""The example sweep program's held-out evaluation, a Lightning callback
(:func:`fp8track.examples.train.train` adds it to the Trainer)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import lightning as L
import torch

from fp8track.examples.trial_config import GAP_BEST_METRIC, GAP_METRIC, VAL_LOSS_METRIC, Evaluation


class HeldOutEval(L.Callback):
    """Held-out loss every ``every`` optimizer steps on fixed batches, compared with the control.

    ``on_eval(evaluation) -> bool`` is called after each evaluation; True stops training (pruning).
    Values go to the trainer's loggers as :data:`VAL_LOSS_METRIC`, :data:`GAP_METRIC`,
    :data:`GAP_BEST_METRIC` (one row per evaluation).
    """

    def __init__(self, data: Any, every: int, batches: int, steps: int, control: Mapping[int, float] | None,
                 precision: str, on_eval: Callable[[Evaluation], bool] | None = None) -> None:
        self.data, self.every, self.batches, self.steps = data, every, batches, steps
        self.control = {int(k): float(v) for k, v in (control or {}).items()}
        self.precision, self.on_eval = precision, on_eval
        self.evals: list[Evaluation] = []
        self.pruned = False
        self.eval_seconds = 0.0
        self._fixed: list[Any] | None = None

    def due(self, step: int) -> bool:
        return self.every > 0 and step > 0 and (step % self.every == 0 or step == self.steps)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if not self.due(step) or (self.evals and self.evals[-1].step == step):
            return
        t0 = time.perf_counter()
        loss = self.evaluate(pl_module)
        ref = self.control.get(step)
        gap = loss - ref if ref is not None else math.nan
        ev = Evaluation(len(self.evals), step, loss, gap)
        self.evals.append(ev)
        best = min((e.gap for e in self.evals if math.isfinite(e.gap)), default=math.nan)
        row = {VAL_LOSS_METRIC: loss}
        if math.isfinite(gap):
            row.update({GAP_METRIC: gap, GAP_BEST_METRIC: best})
        for lg in trainer.loggers:
            lg.log_metrics(row, step=step)
        self.eval_seconds += time.perf_counter() - t0
        if self.on_eval is not None and self.on_eval(ev):
            self.pruned = True
            trainer.should_stop = True

    @torch.no_grad()
    def evaluate(self, pl_module: L.LightningModule) -> float:
        if self._fixed is None:
            self.data.setup()
            self._fixed = [b for _, b in zip(range(self.batches), self.data.val_dataloader(), strict=False)]
        was_training = pl_module.training
        pl_module.eval()
        total = 0.0
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.precision == "bf16-mixed"):
            for x, y in self._fixed:
                total += float(pl_module.model.loss(x.to(pl_module.device), y.to(pl_module.device)))
        pl_module.train(was_training)
        return total / len(self._fixed)
