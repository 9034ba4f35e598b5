"""``FP8Monitor``: the Lightning callback, a thin adapter over :class:`fp8track.monitoring.monitor.Monitor`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from fp8track.errors import ConfigError, invalid_choice
from fp8track.frontend import Monitor
from fp8track.monitoring.capture import LayerFilter
from fp8track.monitoring.monitor import DEFAULT_SCALAR_STATS, MonitorConfig, run_meta_for
from fp8track.monitoring.sharding import ShardSpec
from fp8track.numerics.formats import TENSOR_KINDS

SPIKE_ACTIONS = ("log", "stop", "checkpoint")


class FP8Monitor(Callback):
    """Log FP8 tensor diagnostics of every linear layer to the run directory and the trainer's trackers.

    Add it to a Trainer: ``Trainer(callbacks=[FP8Monitor(every_n_steps=10)], logger=[WandbLogger(...)])``.
    FP8 layers (emulated, torchao, Transformer Engine) are judged with the scale their recipe used;
    on a model without FP8 layers (the BF16 control) the linear layers are judged in shadow mode:
    what current-scaling FP8 would do to their tensors.

    Args:
        every_n_steps: sample every N-th optimizer step (N >= 1).
        layers: ``None`` (all linear layers), ``"re:<regex>"``, a list of names, or a
            ``(module, fqn) -> bool`` filter.
        tensors: subset of ``("activation", "weight", "gradient")``.
        log_dir: parent of the local run directory (default ``<trainer.default_root_dir>/fp8track``).
        trackers: ``"auto"`` (W&B and MLflow loggers found in ``trainer.loggers``), ``"none"``, or a
            list of tracker names / objects.
        steps: extra steps to sample.
        scalar_stats: statistics logged as per-layer scalars.
        whatif: other recipes evaluated on the same tensors (``"current"``, ``"mxfp8"``, ``"block"``).
        per_layer_scalars: False keeps per-layer detail in tables only.
        run_name: name stored in the run metadata.
        baseline: the BF16 control: a local run directory, ``"mlflow:<run_id>"`` (resolved against
            the trainer's MLFlowLogger tracking URI, else ``MLFLOW_TRACKING_URI``) or a W&B
            offline run directory. Adds ``fp8/loss_gap_vs_baseline`` and shared / FP8-only spikes.
        on_spike: ``"log"`` (default: never interferes), ``"stop"`` (stop training when a spike
            or non-finite loss opens) or ``"checkpoint"`` (save a checkpoint then).
        analyzers: replace the default analyzers (spikes/divergence and drift).
        eval_metrics: validation/downstream metrics recorded after each validation as
            ``fp8/eval/<name>``: ``"auto"`` (what the module logged whose name starts with
            ``val``/``eval``/``test``/``downstream``) or a list of logged names.

    Raises:
        ConfigError: at construction for bad values; in ``setup`` when a layer selector matches
            nothing or the model has no linear layer (before the first step).

    Logged metrics: see :class:`fp8track.monitoring.monitor.Monitor` (``loss``, ``fp8/<layer>/<tensor>/<stat>``,
    ``fp8/worst/<stat>``, ``fp8/grad_norm``), and the ``fp8_tensor_stats`` table.
    """

    def __init__(
        self,
        every_n_steps: int = 10,
        layers: str | Sequence[str] | LayerFilter | None = None,
        tensors: Sequence[str] = TENSOR_KINDS,
        log_dir: str | Path | None = None,
        trackers: str | Sequence[Any] = "auto",
        *,
        steps: Sequence[int] = (),
        scalar_stats: Sequence[str] = DEFAULT_SCALAR_STATS,
        whatif: Sequence[str] = (),
        per_layer_scalars: bool = True,
        run_name: str = "fp8track",
        baseline: str | Path | None = None,
        on_spike: str = "log",
        analyzers: Sequence[Any] | None = None,
        eval_metrics: str | Sequence[str] = "auto",
    ) -> None:
        self.config = MonitorConfig(
            every_n_steps=every_n_steps,
            steps=tuple(steps),
            tensors=tuple(tensors),
            scalar_stats=tuple(scalar_stats),
            whatif=tuple(whatif),
            per_layer_scalars=per_layer_scalars,
        )
        if layers is not None and not (callable(layers) or isinstance(layers, (str, list, tuple))):
            raise ConfigError(f"layers must be None, a string, a list of strings or a callable, got {layers!r}")
        from fp8track.trackers import validate_tracker_spec

        validate_tracker_spec(trackers)
        if on_spike not in SPIKE_ACTIONS:
            raise invalid_choice("on_spike action", on_spike, SPIKE_ACTIONS)
        self.baseline = baseline
        self.on_spike = on_spike
        self.analyzers = analyzers
        if not (eval_metrics == "auto" or (not isinstance(eval_metrics, str) and all(isinstance(n, str) for n in eval_metrics))):
            raise ConfigError(f"eval_metrics must be 'auto' or a list of logged metric names, got {eval_metrics!r}")
        self.eval_metrics = eval_metrics if isinstance(eval_metrics, str) else tuple(eval_metrics)
        self.layers = layers
        self.log_dir = log_dir
        self.trackers = trackers
        self.run_name = run_name
        self.monitor: Monitor | None = None
        self._restored: Mapping[str, Any] | None = None
        self._step_at_batch_start = 0
        self._loss_sum: Any = None
        self._micro_batches = 0
        self._grad_norm: Any = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.config.every_n_steps, tensors=self.config.tensors)

    # -- setup: validate against the model before any step -----------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self.monitor is not None:
            return
        self.monitor = self._build_monitor(trainer, pl_module)

    def _build_monitor(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Monitor:
        log_dir = Path(self.log_dir) if self.log_dir is not None else Path(trainer.default_root_dir) / "fp8track"
        trackers: list[Any] = []
        if trainer.is_global_zero and self.trackers not in ("none", None):
            from fp8track.trackers import make_trackers

            trackers = make_trackers(self.trackers, trainer.loggers)
        baseline = None
        if self.baseline is not None:
            from fp8track.analysis.baseline import load_baseline

            baseline = load_baseline(self.baseline, _mlflow_uri(trainer.loggers))
        meta = run_meta_for(
            pl_module,
            self.run_name,
            {"monitor": _config_dict(self.config), "baseline": str(self.baseline) if self.baseline is not None else None},
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
        )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Attach here, not in setup: precision plugins (Transformer Engine) swap layers after setup.
        if self.monitor is None:
            return
        if self._restored is not None:
            self.monitor.load_state_dict(self._restored)
        self._describe_precision(trainer, pl_module)
        self.monitor.attach()
        self.monitor.begin_step(trainer.global_step)

    # -- per step -----------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self.monitor is None:
            return
        if self._micro_batches == 0:  # first micro-batch of an optimizer step
            self.monitor.begin_step(trainer.global_step)
        self._step_at_batch_start = trainer.global_step

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        # Gradients are final (accumulated, AMP-unscaled) here and not yet clipped.
        if self.monitor is not None and self.monitor.config.track_grad_norm:
            from fp8track.monitoring.monitor import total_grad_norm

            self._grad_norm = total_grad_norm(pl_module)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.monitor is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if loss is not None:
            # Lightning divides the loss by accumulate_grad_batches; undo it.
            loss = loss.detach() * trainer.accumulate_grad_batches
            self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
            self._micro_batches += 1
        if trainer.global_step > self._step_at_batch_start:  # an optimizer step completed
            mean_loss = self._loss_sum / self._micro_batches if self._micro_batches else None
            flushed = self.monitor.config.samples(self.monitor.global_step)
            self.monitor.end_step(mean_loss, self._grad_norm)
            self._loss_sum, self._micro_batches, self._grad_norm = None, 0, None
            if flushed and self.on_spike != "log":
                self._act_on_spikes(trainer)

    def _act_on_spikes(self, trainer: pl.Trainer) -> None:
        # Rank 0 saw the events; every rank takes part in the decision (no collective in a
        # rank-0-only branch), then all stop or all save.
        if self.monitor is None:
            return
        opened = any(
            e.kind in ("spike", "nonfinite") and e.data.get("status") == "open" for e in self.monitor.last_events
        )
        if not trainer.strategy.reduce_boolean_decision(opened, all=False):
            return
        if self.on_spike == "stop":
            trainer.should_stop = True
        else:
            path = Path(trainer.default_root_dir) / "fp8track-spikes" / f"spike-step{trainer.global_step}.ckpt"
            trainer.save_checkpoint(path)

    def _describe_precision(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Name the precision set-up in the run metadata (before the run directory is written)."""
        from dataclasses import replace

        from fp8track.monitoring.monitor import precision_setup

        if self.monitor is None or self.monitor.run_dir is not None:
            return
        strategy = trainer.strategy
        offload = getattr(strategy, "cpu_offload", None)
        ds_zero = (getattr(strategy, "config", None) or {}).get("zero_optimization", {}) if hasattr(strategy, "config") else {}
        setup = precision_setup(
            pl_module,
            trainer.optimizers,
            precision_plugin=type(trainer.precision_plugin).__name__,
            precision=str(trainer.precision),
            strategy=type(strategy).__name__,
            cpu_offloading=bool(getattr(offload, "offload_params", offload))
            or bool(ds_zero.get("offload_optimizer") or ds_zero.get("offload_param")),
        )
        meta = self.monitor.meta
        self.monitor.meta = replace(meta, config={**dict(meta.config), "precision": setup})

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Validation metrics per evaluation, so the control comparison covers more than training loss.
        if self.monitor is None or trainer.sanity_checking:
            return
        from fp8track.monitoring.monitor import select_eval_metrics

        self.monitor.record_eval(trainer.global_step, select_eval_metrics(trainer.callback_metrics, self.eval_metrics))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.monitor is not None:
            self.monitor.close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self.monitor is not None:
            self.monitor.close()

    # -- checkpointing ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return self.monitor.state_dict() if self.monitor is not None else dict(self._restored or {})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning restores callbacks after setup and before on_fit_start: keep it for attach time.
        self._restored = dict(state_dict)
        if self.monitor is not None:
            self.monitor.load_state_dict(state_dict)


def _sharding_for(trainer: pl.Trainer) -> ShardSpec | None:
    """The 2-D (data x tensor) mesh of ``ModelParallelStrategy``; ``None`` for the others (DDP's
    replicated weights and FSDP's gathered ones need no mesh: the whole world is data-parallel)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = trainer.strategy
    if not isinstance(strategy, ModelParallelStrategy):
        return None
    return ShardSpec(strategy.device_mesh, data_dims=("data_parallel",))


def _mlflow_uri(loggers: Sequence[Any]) -> str | None:
    """Tracking URI of the trainer's MLFlowLogger (for ``mlflow:<run_id>`` baselines), if any."""
    for logger in loggers:
        if type(logger).__name__ == "MLFlowLogger":
            return getattr(logger, "_tracking_uri", None) or logger.experiment.tracking_uri
    return None


def _config_dict(config: MonitorConfig) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(config)
