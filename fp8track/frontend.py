"""The wiring every frontend shares (plain-PyTorch loop, Lightning callback, CLI): the monitoring
core with fp8track's analyzers (spikes, divergence, drift, the BF16 control) and the tracker
fan-out plugged in. ``monitoring`` defines the interfaces; this module picks the implementations,
so no import runs from ``monitoring`` up to ``analysis`` or ``trackers``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from fp8track.analysis.analyzers import DriftAnalyzer, LossAnalyzer
from fp8track.analysis.baseline import Baseline
from fp8track.analysis.ranking import rank_layers
from fp8track.config import DEFAULT_LOG_DIR, MonitorConfig
from fp8track.errors import ConfigError
from fp8track.execution.apply import ApplyReport
from fp8track.execution.layers import compile_selector
from fp8track.monitoring import monitor as core
from fp8track.monitoring.flop_share import FP8_SHARE_METRIC
from fp8track.monitoring.naming import LOSS_METRIC, run_metric
from fp8track.monitoring.plans import LayerPlan
from fp8track.monitoring.records import EventRecord, RunMeta, RunReader
from fp8track.monitoring.selection import LayerFilter
from fp8track.monitoring.sharding import ShardSpec
from fp8track.trackers import loop_trackers, validate_tracker_spec
from fp8track.trackers.base import Tracker
from fp8track.trackers.fanout import TrackerFanout


def default_analyzers(
    baseline: Baseline | None = None, config: MonitorConfig | None = None
) -> list[core.StepAnalyzer]:
    """Loss spikes and divergence (against ``baseline`` when given) and scale drift, with the
    thresholds of ``config`` (default :class:`fp8track.MonitorConfig`)."""
    c = config or MonitorConfig()
    return [
        LossAnalyzer(c.spikes, c.divergence, baseline=baseline, classify_window=c.classify_window),
        DriftAnalyzer(c.drift, whatif_history_len=c.whatif_history_len),
    ]


BaselineSpec = Baseline | str | Path | None
"""A BF16 control: a loaded :class:`Baseline`, a local run directory, ``"mlflow:<run_id>"`` or a
W&B offline run directory (the forms of :func:`fp8track.analysis.baseline.load_run`)."""


def control_arg(control: BaselineSpec, baseline: BaselineSpec) -> BaselineSpec:
    """The control run given to a frontend: ``control=``, or the older keyword ``baseline=`` (the
    same thing under its former name, kept for one release with a ``DeprecationWarning``).

    Raises:
        ConfigError: both given.
    """
    if baseline is None:
        return control
    if control is not None:
        raise ConfigError("pass the BF16 control once: control= (baseline= is its former name), not both")
    import warnings

    warnings.warn("baseline= is now control= (the BF16 control run); baseline= goes in the next release",
                  DeprecationWarning, stacklevel=3)
    return baseline


def load_control(spec: BaselineSpec, tracking_uri: str | None = None) -> Baseline | None:
    """The control run of a frontend's ``control=`` argument, loaded before training.

    Raises:
        ConfigError: a reference in none of the forms (naming them), a run that does not exist or
            has no loss metric, or an object of another type.
    """
    if spec is None or isinstance(spec, Baseline):
        return spec
    if not isinstance(spec, (str, Path)):
        raise ConfigError(
            f"control must be a run directory, 'mlflow:<run_id>', a W&B offline run directory or a "
            f"loaded fp8track Baseline, got {type(spec).__name__} {spec!r}"
        )
    from fp8track.analysis.baseline import load_baseline

    return load_baseline(spec, tracking_uri)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's own module inside the wrappers that training frameworks put around it, so layer
    names are the same whichever frontend trains it: Lightning Fabric's ``_FabricModule`` (its
    ``module``; hooking the wrapper would prefix every name with ``_forward_module.``), DDP's
    ``module``, and a PEFT model's base model (``get_base_model()``, without ``base_model.model.``).
    The wrappers forward to the same submodules, so hooks on the inner ones see every call."""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        kind = type(model).__name__
        if kind == "_FabricModule" or isinstance(model, DistributedDataParallel):
            model = model.module
        elif kind.startswith("Peft") and callable(getattr(model, "get_base_model", None)):
            model = model.get_base_model()
        else:
            return model


def tracker_sink(trackers: Sequence[Tracker]) -> Callable[[Path], TrackerFanout] | None:
    """A sink factory for :class:`fp8track.monitoring.monitor.MonitorCore`: the failure-tolerant
    fan-out over ``trackers`` (``None`` when there are none)."""
    trackers = list(trackers)
    if not trackers:
        return None
    return lambda run_dir: TrackerFanout(trackers, run_dir)


_SUMMARY_COUNTS = {
    "spikes": run_metric("spikes", "count"),
    "fp8_only_spikes": run_metric("spikes", "fp8_only"),
    "shared_spikes": run_metric("spikes", "shared"),
    "divergences": run_metric("divergence", "count"),
    "drift_events": run_metric("drift", "count"),
}


def run_summary(run_dir: str | Path, top_k: int = 5) -> dict[str, Any]:
    """A run directory at a glance, read back from its records.

    Returns:
        ``run_dir``; ``last_step`` and ``final_loss`` (the last ``fp8/loss``); ``worst_layers``:
        the ``top_k`` riskiest layers of :func:`fp8track.analysis.ranking.rank_layers` as
        ``{"layer", "score", "tensor"}``; ``spikes``, ``fp8_only_spikes``, ``shared_spikes``
        (the last two only with a control), ``divergences``, ``drift_events``: the analyzers' last
        counts (None when never logged); ``loss_gap_vs_baseline``: the last FP8-minus-control
        loss gap in nats (None without a control); ``fp8_flop_share``: the share of the GEMM
        FLOPs that ran in FP8 on the last fully sampled step (None before one).
    """
    reader = RunReader(run_dir)
    last: dict[str, float] = {}
    last_step = None
    for rec in reader.metrics():  # steps are appended in order; a later record wins
        last.update(rec.metrics)
        last_step = rec.step if last_step is None else max(last_step, rec.step)
    risks = rank_layers(reader.tensor_stats())[:top_k]
    out: dict[str, Any] = {
        "run_dir": str(run_dir),
        "last_step": last_step,
        "final_loss": last.get(LOSS_METRIC),
        "worst_layers": [{"layer": r.layer, "score": r.score, "tensor": r.tensor} for r in risks],
    }
    for key, name in _SUMMARY_COUNTS.items():
        out[key] = int(last[name]) if name in last else None
    out["loss_gap_vs_baseline"] = last.get(run_metric("loss_gap_vs_baseline"))
    out["fp8_flop_share"] = last.get(FP8_SHARE_METRIC)
    return out


LAYERS_FORMS = (
    "None (every linear layer), 're:<regex>', a layer or module name, a list of those, or a callable"
)


def check_layers(layers: Any) -> None:
    """The checks of a ``layers=`` selector that need no model (the model's names are checked
    when the monitor selects its layers): its form, a list that is not empty, and each ``re:``
    term compiles.

    Raises:
        ConfigError: naming the bad value and the valid forms (:data:`LAYERS_FORMS`).
    """
    if layers is None or callable(layers):
        return
    if not isinstance(layers, (str, list, tuple)):
        raise ConfigError(f"layers must be {LAYERS_FORMS}, got {type(layers).__name__} {layers!r}")
    terms = [layers] if isinstance(layers, str) else list(layers)
    if not terms:
        raise ConfigError(
            f"layers=[] selects no layer, so nothing would be monitored; layers must be {LAYERS_FORMS}"
        )
    for term in terms:
        if not isinstance(term, str) or not term:
            raise ConfigError(
                f"layer selectors must be non-empty strings, got {term!r}; layers must be {LAYERS_FORMS}"
            )
        compile_selector(term, "layer selector")


def check_frontend_args(layers: Any, eval_metrics: Any) -> None:
    """The checks every training-framework frontend makes at construction (ConfigError)."""
    check_layers(layers)
    names_ok = isinstance(eval_metrics, (list, tuple)) and all(isinstance(n, str) for n in eval_metrics)
    if not (eval_metrics == "auto" or names_ok):
        raise ConfigError(
            f"eval_metrics must be 'auto' or a list of logged metric names, got {eval_metrics!r}"
        )


class FrontendResults:
    """What a training-framework frontend (Lightning callback, HF callback) shows of the run its
    ``monitor`` writes: ``None`` / empty before training and on ranks > 0."""

    monitor: Monitor | None

    @property
    def run_dir(self) -> Path | None:
        """The run directory of the current (or last) run."""
        return self.monitor.run_dir if self.monitor is not None else None

    @property
    def events(self) -> list[EventRecord]:
        """Every event written so far (spikes, divergence, drift, run end), read from the run directory."""
        run_dir = self.run_dir
        return list(RunReader(run_dir).events()) if run_dir is not None else []

    def summary(self, top_k: int = 5) -> dict[str, Any] | None:
        """The run at a glance (:func:`run_summary`): worst layers, spike counts, gap to the control."""
        return run_summary(self.run_dir, top_k) if self.run_dir is not None else None


class Monitor(core.MonitorCore):
    """:class:`fp8track.monitoring.monitor.MonitorCore` for plain PyTorch loops, with the default
    analyzers and the tracker fan-out wired in.

    Args (beyond the core's ``model``, ``layers``, ``plans``, ``log_dir``, ``meta``, ``is_writer``,
    ``sharding``, ``apply_report``: the :class:`~fp8track.execution.apply.ApplyReport` that
    :func:`fp8track.apply_fp8` returned, ``data_fingerprint``: what data the run saw, from
    :func:`fp8track.monitoring.monitor.data_fingerprint`, so the diagnosis pairs runs on the same
    batches):
        config: :class:`fp8track.MonitorConfig`, a mapping or a YAML path (capture settings and
            the detectors' thresholds).
        trackers: where the records go besides the run directory, checked here (a bad value is a
            :class:`ConfigError` naming the valid forms): ``"auto"`` (default: the runs this process
            already logs to, found when the monitor is built: the active MLflow run of
            ``mlflow.start_run()``, else the run of ``MLFLOW_RUN_ID``, as a sweep trial has it, at the
            active tracking URI; and the W&B run of ``wandb.init``; nothing when none is open),
            ``"none"``, ``"mlflow"`` / ``"wandb"`` (that open run, which must exist), or a list of
            those names and :class:`fp8track.trackers.Tracker` objects (used as given). The
            runs found stay the user's: the monitor never ends them.
            (:func:`fp8track.trackers.loop_trackers`).
        control: the BF16 control for the default loss analyzer (``baseline``: its former name):
            a local run directory,
            ``"mlflow:<run_id>"`` (resolved against ``tracking_uri``, else ``MLFLOW_TRACKING_URI``), a
            W&B offline run directory, or a loaded :class:`fp8track.analysis.baseline.Baseline`. Loaded
            here, on the writer rank: a bad reference is a :class:`ConfigError` before training.
        tracking_uri: the MLflow tracking URI of an ``mlflow:`` baseline.
        analyzers: replace the default analyzers (the config's thresholds then do not apply).
        log_dir: parent of the run directory (default ``./fp8track-runs``, :data:`DEFAULT_LOG_DIR`).
        grad_scaler: the ``torch.amp.GradScaler`` of an fp16 loop: the steps it skips are
            ``scaler_skip`` events, never a halt (docs/monitoring.md, "The checkpoint guard").

    A context manager: ``with fp8track.Monitor(model) as mon:`` attaches on entry and closes on exit
    (the losses not yet flushed are written), without a collective when the block raised.
    """

    def __init__(
        self,
        model: nn.Module,
        config: MonitorConfig | Mapping[str, Any] | str | Path | None = None,
        *,
        layers: str | Sequence[str] | LayerFilter | None = None,
        plans: Mapping[str, LayerPlan] | None = None,
        log_dir: str | Path | None = DEFAULT_LOG_DIR,
        trackers: str | Sequence[str | Tracker] = "auto",
        meta: RunMeta | None = None,
        analyzers: Sequence[core.StepAnalyzer] | None = None,
        baseline: BaselineSpec = None,
        tracking_uri: str | None = None,
        is_writer: bool | None = None,
        sharding: ShardSpec | None = None,
        apply_report: ApplyReport | None = None,
        data_fingerprint: Mapping[str, Any] | None = None,
        grad_scaler: Any = None,
        control: BaselineSpec = None,
    ) -> None:
        baseline = control_arg(control, baseline)
        cfg = MonitorConfig.load(config)
        check_frontend_args(layers, "auto")
        validate_tracker_spec(trackers)
        model = unwrap_model(model)
        writer = _global_rank() == 0 if is_writer is None else is_writer
        # The control and the trackers feed rank-0 work only; other ranks never read them (the
        # control may not be there, and the user's runs are open on rank 0 alone).
        baseline = load_control(baseline, tracking_uri) if writer else None
        sinks = loop_trackers(trackers) if writer else []
        super().__init__(
            model,
            cfg,
            layers=layers,
            plans=plans,
            log_dir=log_dir,
            sink=tracker_sink(sinks),
            meta=meta,
            analyzers=default_analyzers(baseline, cfg) if analyzers is None else analyzers,
            is_writer=writer,
            sharding=sharding,
            apply_report=apply_report,
            data_fingerprint=data_fingerprint,
            grad_scaler=grad_scaler,
        )

    def __enter__(self) -> Monitor:
        return self.attach()  # type: ignore[return-value]

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        # After an exception another rank may be dead or inside a different collective.
        self.close(reduce=exc_type is None)

    @property
    def events(self) -> list[EventRecord]:
        """Every event written so far, read from the run directory (empty on ranks > 0)."""
        return list(RunReader(self.run_dir).events()) if self.run_dir is not None else []

    def summary(self, top_k: int = 5) -> dict[str, Any] | None:
        """:func:`run_summary` of this run (None on ranks > 0 or before :meth:`attach`)."""
        return run_summary(self.run_dir, top_k) if self.run_dir is not None else None


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


__all__ = [
    "Monitor",
    "default_analyzers",
    "tracker_sink",
    "run_summary",
    "load_control",
    "BaselineSpec",
    "unwrap_model",
    "check_frontend_args",
    "check_layers",
    "FrontendResults",
]
