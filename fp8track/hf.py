"""``FP8TrainerCallback``: fp8track for Hugging Face ``transformers.Trainer`` (and its subclasses).

::

    from fp8track.hf import FP8TrainerCallback

    trainer = Trainer(model=model, args=TrainingArguments(..., gradient_accumulation_steps=4),
                      callbacks=[FP8TrainerCallback(every_n_steps=10)])
    trainer.train()

How the loss is read. A ``TrainerCallback`` never receives the loss; the model's output does
(``outputs.loss`` when the labels reach the model, as they do unless a label smoother or
``compute_loss_func`` takes them). The loss HF logs is the sum, over the micro-batches of an
optimizer step, of what ``Trainer.training_step`` returns, and ``training_step`` normalises each
micro-batch's loss for gradient accumulation in one of two ways (``Trainer.training_step`` /
``compute_loss``, transformers 4.5x and 5.x):

- the model takes ``num_items_in_batch`` (``model_accepts_loss_kwargs``, every causal LM of
  transformers >= 4.46): HF passes the token count of the whole accumulated batch, so the model's
  loss is already per token of the optimizer step; summed over micro-batches (times the number of
  processes with ``average_tokens_across_devices``, which HF then averages over processes);
- otherwise each micro-batch's mean loss is divided by the number of micro-batches of the step.

The callback's forward hook on the model (training forwards with gradients, inside a step) sees
whether ``num_items_in_batch`` reached the model and applies the same normalisation, so ``fp8/loss``
is the loss HF logs, either way. Where the loss cannot be read that way (no ``outputs.loss``: a
label smoother, ``compute_loss_func``; or a ``compute_loss`` override that computes its own loss,
noticed when HF's logged loss differs), the callback warns once and says to call
``FP8TrainerCallback(...).attach(trainer)``: that wraps the trainer's own ``training_step`` (this
Trainer object only, whatever subclass it is) and records its return values, whatever
``compute_loss`` does. The one difference from HF: HF replaces a NaN/Inf micro-batch loss by the
mean of earlier ones (``logging_nan_inf_filter``); fp8track records the NaN, so the non-finite
detector sees it.

``fp8/grad_norm``: with ``attach`` the norm before clipping, as HF logs it; with ``callbacks=[...]``
it is read in ``on_pre_optimizer_step``, after HF's clipping (``max_grad_norm``): equal to HF's
``grad_norm`` on steps the clip left alone, ``max_grad_norm`` on the others.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from typing_extensions import override

from fp8track.config import DEFAULT_LOG_DIR, MonitorConfig
from fp8track.errors import ConfigError
from fp8track.execution.apply import ApplyReport
from fp8track.frontend import (
    BaselineSpec,
    FrontendResults,
    Monitor,
    check_frontend_args,
    control_arg,
    unwrap_model,
)
from fp8track.monitoring.capture_config import StepAnalyzer
from fp8track.monitoring.reduce import total_grad_norm
from fp8track.monitoring.run_meta import run_meta_for, select_eval_metrics
from fp8track.monitoring.selection import LayerFilter
from fp8track.optional import require
from fp8track.trackers import Tracker, active_mlflow_tracker, active_wandb_tracker

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
        control: the BF16 control (``baseline``: its former name):
            a run directory, ``"mlflow:<run_id>"`` (``tracking_uri``, else
            ``MLFLOW_TRACKING_URI``), a W&B offline run directory or a loaded Baseline.
        log_dir: parent of the run directory (default ``<TrainingArguments.output_dir>/fp8track-runs``).
        config: a :class:`fp8track.MonitorConfig`, a mapping or a YAML path (the rest: tensors,
            statistics, what-if recipes, spike / divergence / drift thresholds).
        analyzers: replace the default analyzers.
        tracking_uri: MLflow tracking URI of an ``mlflow:`` baseline.
        eval_metrics: ``"auto"`` (HF's ``eval_*`` metrics of each evaluation, as ``fp8/eval/<name>``)
            or a list of metric names.
        apply_report: what :func:`fp8track.apply_fp8` returned (recipe and FP8/BF16 layers for the
            run metadata and the FP8 FLOP share check); ``None``: the report of an ``apply_fp8``
            call on the model, if any. The same keyword as ``fp8track.Monitor`` and ``FP8Monitor``.

    Steps are numbered as HF logs them: the first optimizer step is step 1 (``state.global_step``
    after it), so ``fp8/loss`` sits beside HF's own ``loss`` at the same step in W&B and MLflow, and
    ``every_n_steps=10`` samples HF's steps 10, 20, ... ``fp8/loss`` is recorded every optimizer
    step (the loss HF logs, read from the model's output: module docstring), ``fp8/grad_norm`` and
    the tensor statistics on sampled steps. Each ``train()`` writes one run directory, closed at
    ``on_train_end``; ``train(resume_from_checkpoint=...)`` goes on in the run directory of the run
    that wrote the checkpoint (the monitor's state is saved beside it: :data:`STATE_FILE`). A
    Trainer whose ``compute_loss`` computes its own loss: add the callback with
    ``FP8TrainerCallback(...).attach(trainer)`` (it records what ``training_step`` returns).

    Raises:
        ConfigError: at construction for bad values; in ``on_train_begin`` (before the first step)
            when a layer selector matches nothing or the baseline cannot be loaded.

    Example:
        >>> cb = FP8TrainerCallback(every_n_steps=5, trackers="none")
        >>> cb.config.every_n_steps, cb.trackers
        (5, 'none')
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
        apply_report: ApplyReport | None = None,
        control: BaselineSpec = None,
    ) -> None:
        baseline = control_arg(control, baseline)
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
        if apply_report is not None and not isinstance(apply_report, ApplyReport):
            raise ConfigError(
                f"apply_report must be what fp8track.apply_fp8 returned (an ApplyReport) or None, "
                f"got {type(apply_report).__name__}"
            )
        self.apply_report = apply_report
        self.monitor: Monitor | None = None
        self._trainer: Any = None
        self._outputs = _OutputLoss()
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
        # HF's WandbCallback / MLflowCallback opened their runs in their on_train_begin, before ours.
        for name, find in (("wandb", active_wandb_tracker), ("mlflow", active_mlflow_tracker)):
            if name in report_to or "all" in report_to:
                tracker = find()
                if tracker is not None:
                    out.append(tracker)
        return out

    # -- Trainer events -----------------------------------------------------------------------------
    @override
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self.monitor is not None and not self.monitor.closed:
            self.monitor.close()
        trained = model if model is not None else self._trainer.model
        target = unwrap_model(trained)
        writer = bool(state.is_world_process_zero)
        log_dir = Path(self.log_dir) if self.log_dir is not None else Path(args.output_dir) / DEFAULT_LOG_DIR
        self.monitor = Monitor(
            target,
            self.config,
            layers=self.layers,
            log_dir=log_dir,
            trackers=self._trackers(args) if writer else (),
            meta=run_meta_for(
                target, self.config.run_name, {"monitor": self.config.to_dict(), "frontend": "hf"},
                report=self.apply_report,
            ),
            analyzers=self.analyzers,
            baseline=self.baseline,
            tracking_uri=self.tracking_uri,
            is_writer=writer,
            apply_report=self.apply_report,
        )
        self._loss_sum, self._grad_norm = None, None
        if self._trainer is None:  # HF's convention, callbacks=[...]: the loss from the model's output
            processes = args.world_size if args.average_tokens_across_devices else 1
            self._outputs.start(trained, processes, check_logged=args.world_size == 1)
        if state.global_step > 0:  # train(resume_from_checkpoint=...): go on in the same run directory
            self._resume(args, state.global_step)
        self.monitor.global_step = state.global_step + 1  # the next step, in HF's numbering (from 1)
        self.monitor.attach()

    def _resume(self, args: Any, step: int) -> None:
        assert self.monitor is not None
        path = _checkpoint_dir(args, step) / STATE_FILE
        if path.is_file():
            self.monitor.load_state_dict(torch.load(path, weights_only=True))
        else:
            warnings.warn(
                f"fp8track: the Trainer resumed at step {step}, but {path} holds no monitor state "
                "(a checkpoint written without FP8TrainerCallback, or one outside output_dir): this "
                "train() records into a new run directory",
                UserWarning, stacklevel=2,
            )  # fmt: skip

    @override
    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # HF calls it after writing checkpoint-<global_step>/: the monitor's state goes beside it,
        # as Lightning's callback state goes into its checkpoint (one host copy of buffered losses).
        folder = _checkpoint_dir(args, state.global_step)
        if self.monitor is not None and state.is_world_process_zero and folder.is_dir():
            torch.save(self.monitor.state_dict(), folder / STATE_FILE)

    @override
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Called once per optimizer step, before its first micro-batch; HF numbers the step
        # global_step + 1 (the value global_step has when HF logs it).
        if self.monitor is not None:
            self._loss_sum, self._grad_norm = None, None
            self._outputs.begin_step()
            self.monitor.begin_step(state.global_step + 1)

    @override
    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Without attach, the first moment the step's gradients are final (after HF's clipping).
        monitor = self.monitor
        if self._trainer is None and monitor is not None and monitor.sampling:
            if monitor.config.track_grad_norm:
                self._grad_norm = total_grad_norm(monitor.model)

    @override
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # After the optimizer step (state.global_step already counts it). The step's loss as HF logs
        # it (module docstring); end_step takes it as one value.
        if self.monitor is not None:
            loss = self._loss_sum if self._trainer is not None else self._outputs.end_step()
            self.monitor.end_step(loss, self._grad_norm)
            self._loss_sum, self._grad_norm = None, None

    @override
    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if self.monitor is not None and self._trainer is None and isinstance(logs, Mapping):
            self._outputs.compare(logs.get("loss"), state.global_step)

    @override
    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any) -> None:
        if self.monitor is not None and metrics:
            self.monitor.record_eval(state.global_step, select_eval_metrics(metrics, self.eval_metrics))

    @override
    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._outputs.stop()
        if self.monitor is not None:
            self.monitor.close()


STATE_FILE = "fp8track_monitor.pt"
"""The monitor's state (:meth:`fp8track.Monitor.state_dict`) in each HF checkpoint folder: written by
``on_save``, read when ``train(resume_from_checkpoint=...)`` resumes from that folder, so the
resumed run appends to the run directory it started (steps after the checkpoint written once)."""


def _checkpoint_dir(args: Any, step: int) -> Path:
    """HF's checkpoint folder of ``step`` (``Trainer._save_checkpoint``:
    ``<output_dir>/checkpoint-<step>``)."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    return Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{step}"


ATTACH_HINT = "call FP8TrainerCallback(...).attach(trainer) before trainer.train() to record it"


class _OutputLoss:
    """The loss HF logs, read from the model's output by a forward hook (module docstring).

    Counts the training forwards of a step (gradients on, module in training mode, between
    ``begin_step`` and ``end_step``) and sums their ``outputs.loss`` in two parts: those normalised
    by HF's ``num_items_in_batch`` (already per token of the whole step) and the plain means (divided
    by the step's number of micro-batches at the end). Device tensors only: no host sync per step.
    """

    def __init__(self) -> None:
        self._handle: Any = None
        self._processes = 1
        self._check_logged = False
        self._in_step = False
        self._per_step: Any = None  # normalised losses (num_items_in_batch), summed
        self._means: Any = None  # plain mean losses, summed
        self._micro_batches = 0
        self._unread = False
        self._since_log: Any = None  # sum of the recorded step losses since HF's last loss log
        self._steps_since_log = 0
        self._warned = False

    def start(self, model: Any, processes: int, check_logged: bool) -> None:
        self.stop()
        self._processes, self._check_logged = max(int(processes), 1), check_logged
        self._since_log, self._steps_since_log = None, 0
        self._handle = model.register_forward_hook(self._hook, with_kwargs=True)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def begin_step(self) -> None:
        self._in_step, self._per_step, self._means, self._micro_batches, self._unread = (
            True, None, None, 0, False,
        )

    def _hook(self, module: Any, args: Any, kwargs: Mapping[str, Any], output: Any) -> None:
        import torch

        if not (self._in_step and module.training and torch.is_grad_enabled()):
            return
        self._micro_batches += 1
        loss = _output_loss(output, "labels" in kwargs)
        if loss is None:
            self._unread = True
            return
        loss = loss.detach().float()
        if kwargs.get("num_items_in_batch") is not None:
            loss = loss * self._processes
            self._per_step = loss if self._per_step is None else self._per_step + loss
        else:
            self._means = loss if self._means is None else self._means + loss

    def end_step(self) -> Any:
        """The step's loss as HF logs it, or None (then a one-time warning says why)."""
        self._in_step = False
        if self._unread or (self._per_step is None and self._means is None):
            self._warn(
                "FP8TrainerCallback cannot read this step's loss from the model's output (no "
                "outputs.loss: the labels did not reach the model, as with a label smoother or "
                "compute_loss_func, or the Trainer computes the loss itself); fp8/loss is not recorded: "
                + ATTACH_HINT
            )
            return None
        loss = self._per_step
        if self._means is not None:
            mean = self._means / self._micro_batches
            loss = mean if loss is None else loss + mean
        if self._check_logged:
            self._since_log = loss if self._since_log is None else self._since_log + loss
            self._steps_since_log += 1
        return loss

    def compare(self, logged: Any, step: int) -> None:
        """At HF's loss log: warn once when the loss HF logged differs from what was recorded
        (a ``compute_loss`` override computes another loss than the model's output)."""
        if logged is None or not self._check_logged:
            return
        ours, n = self._since_log, self._steps_since_log
        self._since_log, self._steps_since_log = None, 0
        if ours is None or n == 0 or self._warned:
            return
        mean = float(ours) / n
        if not (math.isfinite(mean) and math.isfinite(float(logged))):
            return  # HF filters non-finite losses (logging_nan_inf_filter); fp8track keeps them
        if abs(mean - float(logged)) > 1e-3 * max(1.0, abs(float(logged))):
            self._warn(
                f"fp8/loss ({mean:.6g}) differs from the loss HF logged ({float(logged):.6g}) at step "
                f"{step}: the Trainer computes its loss otherwise than the model's outputs.loss "
                "(a compute_loss override); " + ATTACH_HINT
            )

    def _warn(self, text: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"fp8track: {text}", stacklevel=3)


def _output_loss(output: Any, labels_given: bool) -> Any:
    """``outputs.loss`` of a model output (``ModelOutput``, a mapping, or a tuple whose first item
    is the loss when the labels were passed, as HF reads it), or None."""
    import torch

    if isinstance(output, Mapping):
        loss = output.get("loss")
    elif isinstance(output, (tuple, list)):
        loss = output[0] if labels_given and output else None
    else:
        loss = getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


__all__ = ["FP8TrainerCallback"]
