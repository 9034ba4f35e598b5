"""``FP8Monitor``: the Lightning callback, a thin adapter over :class:`fp8track.Monitor`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from fp8track.analysis.spikes import SPIKE_ACTIONS
from fp8track.config import DEFAULT_LOG_DIR, MonitorConfig
from fp8track.errors import invalid_choice
from fp8track.execution.apply import ApplyReport
from fp8track.frontend import FrontendResults, Monitor, check_frontend_args, control_arg, load_control
from fp8track.monitoring.capture_config import StepAnalyzer
from fp8track.monitoring.reduce import total_grad_norm
from fp8track.monitoring.run_meta import run_meta_for
from fp8track.monitoring.selection import LayerFilter
from fp8track.monitoring.sharding import ShardSpec
from fp8track.trackers import Tracker


class FP8Monitor(Callback, FrontendResults):
    """Log FP8 tensor diagnostics of every linear layer to the run directory and the trainer's loggers.

    Add it to a Trainer: ``Trainer(callbacks=[FP8Monitor(every_n_steps=10)], logger=[WandbLogger(...)])``,
    or from LightningCLI: ``--trainer.callbacks+=fp8track.FP8Monitor --trainer.callbacks.every_n_steps=10``
    (a YAML config: ``fp8track integrations --copy DIR``, ``lightning/fp8monitor.yaml``).
    FP8 layers (emulated, torchao, Transformer Engine) are judged with the scale their recipe used;
    on a model without FP8 layers (the BF16 control) the linear layers are judged in shadow mode:
    what current-scaling FP8 would do to their tensors.

    Args:
        every_n_steps: sample every N-th optimizer step (N >= 1); overrides ``config.every_n_steps``
            (default 10).
        layers: ``None`` (all linear layers), ``"re:<regex>"``, a list of names, or a
            ``(module, fqn) -> bool`` filter.
        trackers: ``"auto"`` (every logger in ``trainer.loggers``: W&B and MLflow get their native
            views with tables and figures, any other logger the scalar metrics through
            ``log_metrics``), ``"none"``, or a list of tracker names (``"wandb"``, ``"mlflow"``) /
            :class:`fp8track.trackers.Tracker` objects.
        control: the BF16 control (``baseline``: its former name):
            a local run directory, ``"mlflow:<run_id>"`` (resolved against
            the trainer's MLFlowLogger tracking URI, else ``MLFLOW_TRACKING_URI``) or a W&B
            offline run directory. Adds ``fp8/loss_gap_vs_baseline`` and shared / FP8-only spikes.
        on_spike: ``"log"`` (never interferes), ``"stop"`` (stop training when a spike or a
            non-finite loss opens) or ``"checkpoint"`` (save a checkpoint then); overrides
            ``config.spikes.action`` (default ``"log"``).
        log_dir: parent of the local run directory (default ``<trainer.default_root_dir>/fp8track-runs``,
            which is ``./fp8track-runs`` unless the Trainer's ``default_root_dir`` is set).
        config: the rest, as a :class:`fp8track.MonitorConfig`, a mapping or a YAML path: captured
            tensors and statistics, what-if recipes, and the spike / divergence / drift thresholds.
        analyzers: replace the default analyzers (then ``config``'s thresholds do not apply).
        eval_metrics: validation/downstream metrics recorded after each validation as
            ``fp8/eval/<name>``: ``"auto"`` (what the module logged whose name starts with
            ``val``/``eval``/``test``/``downstream``) or a list of logged names.
        apply_report: what :func:`fp8track.apply_fp8` returned (recipe and FP8/BF16 layers for
            the run metadata); ``None``: the report of an ``apply_fp8`` call on the module, if any.
        on_nonfinite: ``"stop"`` (default: a non-finite loss, gradient norm or parameter raises
            :class:`fp8track.errors.TrainingHalted` before any checkpoint of that step is written,
            from this callback's ``on_train_batch_end``, which runs before ``ModelCheckpoint``'s,
            or from ``on_save_checkpoint``) or ``"log"``; overrides ``config.on_nonfinite``.
            ``config.on_divergence="stop"`` does the same for a divergence onset.

    Raises:
        ConfigError: at construction for bad values; in ``on_fit_start`` (after precision plugins
            converted the model, before the first step) when a layer selector matches nothing or
            the model has no linear layer.

    Each ``fit`` writes one run directory (a fit resumed from a checkpoint appends to the run it
    resumes). ``validate``, ``test`` and ``predict`` are not monitored.

    Logged metrics (all under ``fp8/``, never touching the user's own names): ``fp8/loss`` (every
    optimizer step, un-normalised mean over micro-batches), ``fp8/grad_norm``,
    ``fp8/<layer>/<tensor>/<stat>``, ``fp8/worst/<stat>``, ``fp8/spikes/count``,
    ``fp8/divergence/count``, ``fp8/drift/count``, ``fp8/loss_gap_vs_baseline`` (see
    :class:`fp8track.monitoring.monitor.MonitorCore` and :mod:`fp8track.analysis.analyzers`), and the
    ``fp8_tensor_stats``, ``fp8_spike_events``, ``fp8_drift_events`` tables (W&B, MLflow).

    Example:
        >>> cb = FP8Monitor(every_n_steps=5, trackers="none", config={"spikes": {"z_threshold": 8}})
        >>> cb.config.every_n_steps, cb.config.spikes.z_threshold
        (5, 8)
    """

    def __init__(
        self,
        every_n_steps: int | None = None,
        layers: str | list[str] | LayerFilter | None = None,
        trackers: str | list[str] | list[Tracker] = "auto",
        baseline: str | None = None,
        on_spike: str | None = None,
        log_dir: str | None = None,
        config: MonitorConfig | dict[str, Any] | str | None = None,
        *,
        analyzers: Sequence[StepAnalyzer] | None = None,
        eval_metrics: str | Sequence[str] = "auto",
        apply_report: ApplyReport | None = None,
        on_nonfinite: str | None = None,
        control: str | None = None,
    ) -> None:
        baseline = control_arg(control, baseline)
        cfg = MonitorConfig.load(config)
        changes: dict[str, Any] = {}
        if on_nonfinite is not None:
            changes["on_nonfinite"] = on_nonfinite
        if every_n_steps is not None:
            changes["every_n_steps"] = every_n_steps
        if on_spike is not None:
            if on_spike not in SPIKE_ACTIONS:
                raise invalid_choice("on_spike action", on_spike, SPIKE_ACTIONS)
            changes["spikes"] = dataclasses.replace(cfg.spikes, action=on_spike)
        self.config = cfg.replace(**changes) if changes else cfg
        check_frontend_args(layers, eval_metrics)
        from fp8track.trackers import validate_tracker_spec

        validate_tracker_spec(trackers)
        self.eval_metrics = eval_metrics if isinstance(eval_metrics, str) else tuple(eval_metrics)
        self.layers = layers
        self.trackers = trackers
        self.baseline = str(baseline) if baseline is not None else None
        self.log_dir = log_dir
        self.analyzers = analyzers
        self.apply_report = apply_report
        self.monitor: Monitor | None = None
        self._restored: Mapping[str, Any] | None = None
        self._step_at_batch_start = 0
        self._loss_sum: Any = None
        self._micro_batches = 0
        self._grad_norm: Any = None

    @property
    def on_spike(self) -> str:
        return self.config.spikes.action

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.config.every_n_steps, tensors=self.config.tensors)

    # -- layer selection: at on_fit_start, after precision plugins converted the model -------------
    # Lightning runs Callback.setup, then configure_model, then Strategy.setup, whose
    # precision_plugin.convert_module swaps layers (TransformerEnginePrecision, any plugin that
    # replaces modules); on_fit_start is the first hook that sees the final modules, still before
    # the first step, so a bad selector still fails before training.

    def _build_monitor(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Monitor:
        log_dir = (
            Path(self.log_dir)
            if self.log_dir is not None
            else Path(trainer.default_root_dir) / DEFAULT_LOG_DIR
        )
        trackers: list[Any] = []
        baseline = None
        if trainer.is_global_zero:  # trackers and the control feed rank-0 work only
            from fp8track.trackers import make_trackers, mlflow_tracking_uri

            if self.trackers not in ("none", None):
                trackers = make_trackers(self.trackers, trainer.loggers)
            if self.baseline is not None:
                baseline = load_control(self.baseline, mlflow_tracking_uri(trainer.loggers))
        meta = run_meta_for(
            pl_module, self.config.run_name, {"monitor": self.config.to_dict(), "baseline": self.baseline},
            report=self.apply_report,
        )
        return Monitor(
            pl_module,
            self.config,
            layers=self.layers,
            log_dir=log_dir,
            trackers=trackers,
            meta=meta,
            analyzers=self.analyzers,
            baseline=baseline,
            is_writer=trainer.is_global_zero,
            sharding=_sharding_for(trainer),
            apply_report=self.apply_report,
        )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.monitor is None or self.monitor.closed:
            self.monitor = self._build_monitor(trainer, pl_module)  # a new run for every fit
            # A data module that says what it feeds (seed, batch order): recorded in the run metadata
            # so the diagnosis compares two runs on the same batches step by step (analysis/loss_gap.py).
            fingerprint = getattr(getattr(trainer, "datamodule", None), "data_fingerprint", None)
            if callable(fingerprint):
                self.monitor.record_data(fingerprint())
        if self._restored is not None:
            self.monitor.load_state_dict(self._restored)
            self._restored = None
        self._describe_precision(trainer, pl_module)
        self.monitor.watch_grad_scaler(_grad_scaler_of(trainer))
        self._loss_sum, self._micro_batches, self._grad_norm = None, 0, None
        self.monitor.attach()
        self.monitor.begin_step(trainer.global_step)

    # -- per step -----------------------------------------------------------------------------------
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.monitor is None:
            return
        if self._micro_batches == 0:  # first micro-batch of an optimizer step
            self.monitor.begin_step(trainer.global_step)
        self._step_at_batch_start = trainer.global_step

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        # Gradients are final (accumulated, AMP-unscaled) here and not yet clipped.
        if self.monitor is not None and self.monitor.config.track_grad_norm and self.monitor.sampling:
            self._grad_norm = total_grad_norm(pl_module)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.monitor is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if loss is not None:
            # Lightning divides the loss by accumulate_grad_batches (automatic optimisation); undo it.
            scale = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
            loss = loss.detach() * scale
            self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
        self._micro_batches += 1
        if trainer.global_step > self._step_at_batch_start:  # an optimizer step completed
            mean_loss = self._loss_sum / self._micro_batches if self._loss_sum is not None else None
            flushed = self.monitor.sampling
            self.monitor.end_step(mean_loss, self._grad_norm)
            self._loss_sum, self._micro_batches, self._grad_norm = None, 0, None
            if flushed:
                # Before ModelCheckpoint's own on_train_batch_end (Lightning runs checkpoint
                # callbacks last): a halted run never saves this step.
                self._halt_if(trainer, self.monitor.halt_reason, "after")
                if self.on_spike != "log":
                    self._act_on_spikes(trainer)

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Every save (ModelCheckpoint, trainer.save_checkpoint) passes here before the file is
        # written: the guard checks the unflushed losses and the parameters, and raising here
        # leaves the last good checkpoint the latest one.
        if self.monitor is None or self.monitor.closed:
            return
        self._halt_if(trainer, self.monitor.guard(), "before saving the checkpoint of")

    def _halt_if(self, trainer: pl.Trainer, reason: str | None, when: str) -> None:
        """Stop training (every rank alike) when a rank's guard gave a reason."""
        if not trainer.strategy.reduce_boolean_decision(reason is not None, all=False):
            return
        from fp8track.errors import TrainingHalted

        why = reason or "another rank saw a non-finite loss, gradient or parameter"
        raise TrainingHalted(
            f"fp8track stopped training {when} step {trainer.global_step}: {why} "
            f"(on_nonfinite={self.config.on_nonfinite!r}; the last checkpoint written before it is the "
            "last good one; records: the 'halt' event of the run directory)"
        )

    def _act_on_spikes(self, trainer: pl.Trainer) -> None:
        # Rank 0 saw the events; every rank takes part in the decision (no collective in a
        # rank-0-only branch), then all stop or all save.
        if self.monitor is None:
            return
        opened = any(
            e.kind in ("spike", "nonfinite") and e.data.get("status") == "open"
            for e in self.monitor.last_events
        )
        if not trainer.strategy.reduce_boolean_decision(opened, all=False):
            return
        if self.on_spike == "stop":
            trainer.should_stop = True
        else:
            path = (
                Path(trainer.default_root_dir) / "fp8track-spikes" / f"spike-step{trainer.global_step}.ckpt"
            )
            trainer.save_checkpoint(path)

    def _describe_precision(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Name the precision set-up in the run metadata (before the run directory is written)."""
        from dataclasses import replace

        from fp8track.monitoring.run_meta import precision_setup

        if self.monitor is None or self.monitor.run_dir is not None:
            return
        strategy = trainer.strategy
        offload = getattr(strategy, "cpu_offload", None)
        ds_zero = (
            (getattr(strategy, "config", None) or {}).get("zero_optimization", {})
            if hasattr(strategy, "config")
            else {}
        )
        setup = precision_setup(
            pl_module,
            trainer.optimizers,
            report=self.monitor.apply_report,
            precision_plugin=type(trainer.precision_plugin).__name__,
            precision=str(trainer.precision),
            strategy=type(strategy).__name__,
            cpu_offloading=bool(getattr(offload, "offload_params", offload))
            or bool(ds_zero.get("offload_optimizer") or ds_zero.get("offload_param")),
        )
        meta = self.monitor.meta
        self.monitor.meta = replace(meta, config={**dict(meta.config), "precision": setup})

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Validation metrics per evaluation, so the control comparison covers more than training loss.
        if self.monitor is None or trainer.sanity_checking:
            return
        from fp8track.monitoring.run_meta import select_eval_metrics

        self.monitor.record_eval(
            trainer.global_step, select_eval_metrics(trainer.callback_metrics, self.eval_metrics)
        )

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.monitor is not None:
            self.monitor.close()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # Another rank may be dead or waiting in a different collective: close without reducing.
        if self.monitor is not None:
            self.monitor.close(reduce=False)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":  # state restored for validate/test/predict must not leak into a later fit
            self._restored = None

    # -- checkpointing ------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        return self.monitor.state_dict() if self.monitor is not None else dict(self._restored or {})

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning restores callbacks after setup and before on_fit_start: keep it for attach time.
        self._restored = dict(state_dict)


def _grad_scaler_of(trainer: pl.Trainer) -> Any:
    """The loss scaler of the precision plugin (``MixedPrecision`` and ``FSDPPrecision`` under
    ``"16-mixed"`` hold it as ``scaler``), or None: its skipped steps are no halt."""
    import torch

    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return scaler if isinstance(scaler, torch.amp.GradScaler) else None


def _sharding_for(trainer: pl.Trainer) -> ShardSpec | None:
    """The 2-D (data x tensor) mesh of ``ModelParallelStrategy``; ``None`` for the others (DDP's
    replicated weights and FSDP's gathered ones need no mesh: the whole world is data-parallel)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = trainer.strategy
    if not isinstance(strategy, ModelParallelStrategy):
        return None
    return ShardSpec(strategy.device_mesh, data_dims=("data_parallel",))
