"""``FP8TrainerCallback``: fp8track for Hugging Face ``transformers.Trainer`` (and its subclasses).

::

    from fp8track.hf import FP8TrainerCallback

    trainer = Trainer(model=model, args=TrainingArguments(..., gradient_accumulation_steps=4), ...)
    FP8TrainerCallback(every_n_steps=10).attach(trainer)
    trainer.train()

Why ``attach(trainer)`` and not only ``callbacks=[...]``: a ``TrainerCallback`` never receives the
loss. The loss HF logs is the sum, over the micro-batches of an optimizer step, of what
``Trainer.training_step`` returns, and ``training_step`` has already normalised each micro-batch's
loss for gradient accumulation: divided by the number of micro-batches, or, when the model takes
``num_items_in_batch`` (every causal LM of transformers >= 4.46), by the token count of the whole
accumulated batch (``Trainer.training_step`` / ``compute_loss`` in transformers 4.5x and 5.x). The
model's own ``outputs.loss`` per micro-batch is therefore not the step's loss (averaging it gives
half HF's value at 2 micro-batches in one case and a per-micro-batch mean instead of a per-token mean
in the other). ``attach`` wraps the trainer's own ``training_step`` (the method of this Trainer
object only, whatever subclass it is) and records its return values, so ``fp8/loss`` is exactly
the loss HF logs, for either normalisation. The one difference: HF replaces a NaN/Inf micro-batch
loss by the mean of earlier ones (``logging_nan_inf_filter``); fp8track records the NaN, so the
non-finite detector sees it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fp8track.config import DEFAULT_LOG_DIR, MonitorConfig
from fp8track.errors import ConfigError
from fp8track.frontend import BaselineSpec, FrontendResults, Monitor, check_frontend_args, unwrap_model
from fp8track.monitoring.capture import LayerFilter
from fp8track.monitoring.capture_config import StepAnalyzer
from fp8track.monitoring.reduce import total_grad_norm
from fp8track.monitoring.run_meta import run_meta_for, select_eval_metrics
from fp8track.optional import require
from fp8track.trackers import Tracker

# transformers.Trainer cannot start without accelerate: both are the "hf" extra.
require("accelerate", "fp8track's Hugging Face Trainer callback")
TrainerCallback = require("transformers", "fp8track's Hugging Face Trainer callback").TrainerCallback

TRACKER_SPECS = ("auto", "none")


class FP8TrainerCallback(TrainerCallback, FrontendResults):
    """FP8 tensor diagnostics and the true training loss of a Hugging Face ``Trainer`` run.

    Args:
        every_n_steps: sample every N-th optimizer step (N >= 1); overrides ``config.every_n_steps``.
        layers: ``None`` (every linear layer), ``"re:<regex>"``, a list of names or a
            ``(module, fqn) -> bool`` filter. Records carry canonical names
            (:func:`fp8track.monitoring.naming.canonical_layer_name`): under LoRA the base layers
            keep their names without it (``model.layers.0.self_attn.q_proj``).
        trackers: ``"auto"`` (the trackers of ``TrainingArguments.report_to`` that fp8track serves:
            ``"wandb"``, the run HF's ``WandbCallback`` opened; ``"mlflow"``, the active run HF's
            ``MLflowCallback`` started; others get nothing from fp8track), ``"none"``, or a list of
            :class:`fp8track.trackers.Tracker` objects.
        baseline: the BF16 control: a run directory, ``"mlflow:<run_id>"`` (``tracking_uri``, else
            ``MLFLOW_TRACKING_URI``), a W&B offline run directory or a loaded Baseline.
        log_dir: parent of the run directory (default ``<TrainingArguments.output_dir>/fp8track-runs``).
        config: a :class:`fp8track.MonitorConfig`, a mapping or a YAML path (the rest: tensors,
            statistics, what-if recipes, spike / divergence / drift thresholds).
        analyzers: replace the default analyzers.
        tracking_uri: MLflow tracking URI of an ``mlflow:`` baseline.
        eval_metrics: ``"auto"`` (HF's ``eval_*`` metrics of each evaluation, as ``fp8/eval/<name>``)
            or a list of metric names.

    Steps are numbered as HF logs them: the first optimizer step is step 1 (``state.global_step``
    after it), so ``fp8/loss`` sits beside HF's own ``loss`` at the same step in W&B and MLflow, and
    ``every_n_steps=10`` samples HF's steps 10, 20, ... ``fp8/loss`` is recorded every optimizer
    step, ``fp8/grad_norm`` (before clipping, as HF logs it) and the tensor statistics on sampled
    steps. Each ``train()`` writes one run directory, closed at ``on_train_end``.

    Raises:
        ConfigError: at construction for bad values; in ``on_train_begin`` (before the first step)
            when the callback was not attached to the trainer, a layer selector matches nothing, or
            the baseline cannot be loaded.
    """

    def __init__(
        self,
        every_n_steps: int | None = None,
        layers: str | Sequence[str] | LayerFilter | None = None,
        trackers: str | Sequence[Tracker] = "auto",
        baseline: BaselineSpec = None,
        log_dir: str | Path | None = None,
        config: MonitorConfig | dict[str, Any] | str | Path | None = None,
        *,
        analyzers: Sequence[StepAnalyzer] | None = None,
        tracking_uri: str | None = None,
        eval_metrics: str | Sequence[str] = "auto",
    ) -> None:
        cfg = MonitorConfig.load(config)
        self.config = cfg.replace(every_n_steps=every_n_steps) if every_n_steps is not None else cfg
        check_frontend_args(layers, eval_metrics)
        if isinstance(trackers, str) and trackers not in TRACKER_SPECS:
            raise ConfigError(
                f"unknown trackers {trackers!r}; "
                "valid values are: 'auto', 'none' or a list of Tracker objects"
            )
        if not isinstance(trackers, str) and not (
            isinstance(trackers, (list, tuple)) and all(isinstance(t, Tracker) for t in trackers)
        ):
            raise ConfigError(
                f"trackers must be 'auto', 'none' or a list of fp8track Tracker objects, got {trackers!r}"
            )
        self.layers = layers
        self.trackers = trackers if isinstance(trackers, str) else tuple(trackers)
        self.baseline = baseline
        self.tracking_uri = tracking_uri
        self.log_dir = log_dir
        self.analyzers = analyzers
        self.eval_metrics = eval_metrics if isinstance(eval_metrics, str) else tuple(eval_metrics)
        self.monitor: Monitor | None = None
        self._trainer: Any = None
        self._loss_sum: Any = None
        self._grad_norm: Any = None

    # -- wiring -------------------------------------------------------------------------------------
    def attach(self, trainer: Any) -> FP8TrainerCallback:
        """Add this callback to ``trainer`` (unless it is there) and record the loss of each
        micro-batch from ``trainer.training_step`` (module docstring). Returns ``self``."""
        if self._trainer is trainer:
            return self
        if self._trainer is not None:
            raise ConfigError(
                "this FP8TrainerCallback is attached to another Trainer; build one callback per Trainer"
            )
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        original = trainer.training_step

        @functools.wraps(original)
        def training_step(*args: Any, **kwargs: Any) -> Any:
            loss = original(*args, **kwargs)
            self._micro_batch_done(loss, trainer)
            return loss

        trainer.training_step = training_step  # this Trainer object only; its class is untouched
        self._trainer = trainer
        return self

    def _micro_batch_done(self, loss: Any, trainer: Any) -> None:
        if self.monitor is None:
            return
        loss = loss.detach().float()
        self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
        # The last micro-batch's backward has produced the final (accumulated, all-reduced) gradients;
        # HF clips them after training_step returns, and logs the norm from before clipping.
        if (
            trainer.accelerator.sync_gradients
            and self.monitor.sampling
            and self.monitor.config.track_grad_norm
        ):
            self._grad_norm = total_grad_norm(self.monitor.model)

    def _trackers(self, args: Any) -> list[Tracker]:
        if self.trackers == "none":
            return []
        if self.trackers != "auto":
            return list(self.trackers)
        report_to = args.report_to if isinstance(args.report_to, (list, tuple)) else [args.report_to]
        out: list[Tracker] = []
        if "wandb" in report_to or "all" in report_to:
            import wandb

            from fp8track.trackers.wandb import WandbTracker

            if wandb.run is not None:  # HF's WandbCallback opened it in its on_train_begin, before ours
                out.append(WandbTracker(wandb.run))
        if "mlflow" in report_to or "all" in report_to:
            import mlflow

            from fp8track.trackers.mlflow import MLflowTracker

            active = mlflow.active_run()  # started by HF's MLflowCallback
            if active is not None:
                client = mlflow.MlflowClient(mlflow.get_tracking_uri())
                out.append(MLflowTracker(client=client, run_id=active.info.run_id))
        return out

    # -- Trainer events -----------------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self._trainer is None:
            raise ConfigError(
                "FP8TrainerCallback needs the Trainer to read each micro-batch's loss "
                "(a TrainerCallback never receives it): "
                "call FP8TrainerCallback(...).attach(trainer) before trainer.train()"
            )
        if self.monitor is not None and not self.monitor.closed:
            self.monitor.close()
        target = unwrap_model(model if model is not None else self._trainer.model)
        writer = bool(state.is_world_process_zero)
        log_dir = Path(self.log_dir) if self.log_dir is not None else Path(args.output_dir) / DEFAULT_LOG_DIR
        self.monitor = Monitor(
            target,
            self.config,
            layers=self.layers,
            log_dir=log_dir,
            trackers=self._trackers(args) if writer else (),
            meta=run_meta_for(
                target, self.config.run_name, {"monitor": self.config.to_dict(), "frontend": "hf"}
            ),
            analyzers=self.analyzers,
            baseline=self.baseline,
            tracking_uri=self.tracking_uri,
            is_writer=writer,
        )
        self._loss_sum, self._grad_norm = None, None
        self.monitor.global_step = state.global_step + 1  # the next step, in HF's numbering (from 1)
        self.monitor.attach()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Called once per optimizer step, before its first micro-batch; HF numbers the step
        # global_step + 1 (the value global_step has when HF logs it).
        if self.monitor is not None:
            self._loss_sum, self._grad_norm = None, None
            self.monitor.begin_step(state.global_step + 1)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # After the optimizer step (state.global_step already counts it). The sum of training_step's
        # returns is the step's loss as HF logs it (module docstring); end_step takes it as one value.
        if self.monitor is not None:
            self.monitor.end_step(self._loss_sum, self._grad_norm)
            self._loss_sum, self._grad_norm = None, None

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any) -> None:
        if self.monitor is not None and metrics:
            self.monitor.record_eval(state.global_step, select_eval_metrics(metrics, self.eval_metrics))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is not None:
            self.monitor.close()


__all__ = ["FP8TrainerCallback"]
