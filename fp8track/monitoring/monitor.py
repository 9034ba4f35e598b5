"""Framework-agnostic FP8 monitor: capture -> statistics -> rank reduction -> records -> trackers.

Plain PyTorch::

    monitor = MonitorCore(model, CaptureConfig(every_n_steps=10), log_dir="runs")
    for batch in loader:
        loss = model(batch).loss
        loss.backward(); opt.step()
        monitor.step(loss=loss)            # once per optimizer step, before zero_grad
        opt.zero_grad()
    monitor.close()

Per sampled step the hooks accumulate device-side partials; :meth:`MonitorCore.step` then does one
reduction across ranks (one SUM and one MAX collective for all layers, losses included), one
host copy, and on rank 0 alone writes the run directory and forwards the batch to trackers.
Losses of unsampled steps stay on the device until the next sampled step.

:class:`MonitorCore` orchestrates; each job has its module: what to capture
(:mod:`~fp8track.monitoring.capture_config`, :mod:`~fp8track.monitoring.selection`), when
(:class:`~fp8track.monitoring.schedule.Sampler`), the cross-rank reduction every rank runs
(:mod:`~fp8track.monitoring.reduce`, :mod:`~fp8track.monitoring.router_flush`), and the writer's part
of a flush (:mod:`~fp8track.monitoring.flush_writer`): the checkpoint guard
(:mod:`~fp8track.monitoring.guard`), the FP8 FLOP share (:mod:`~fp8track.monitoring.flop_share`),
tensor dumps (:mod:`~fp8track.monitoring.dumps`) and what is written (:mod:`~fp8track.monitoring.emit`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fp8track.errors import ConfigError, warn_user
from fp8track.execution.apply import ApplyReport, applied_report
from fp8track.monitoring.capture_config import (  # re-exported: they lived here before
    DEFAULT_BURST_STEPS,
    DEFAULT_SCALAR_STATS,
    GUARD_ACTIONS,
    WORST_MAX,
    WORST_MIN,
    CaptureConfig,
    StepAnalyzer,
    StepSink,
)
from fp8track.monitoring.collector import collector_paused
from fp8track.monitoring.emit import RunOutput, eval_metrics
from fp8track.monitoring.flop_share import FP8_SHARE_METRIC
from fp8track.monitoring.flush_writer import FlushWriter
from fp8track.monitoring.grad_scaler import check_grad_scaler, current_scale
from fp8track.monitoring.plans import LayerPlan
from fp8track.monitoring.records import EventRecord, RunMeta, TensorStatsRow
from fp8track.monitoring.reduce import (
    DeviceTake,
    PendingStep,
    detached,
    pending_from_state,
    pending_state,
    reduce_to_host,
    share_burst,
    take_partials,
    total_grad_norm,
)
from fp8track.monitoring.reduce import dist_rank as _dist_rank

# Looked up in this module at each flush: a test fakes a world of several ranks by replacing it here.
from fp8track.monitoring.reduce import dist_world as _dist_world
from fp8track.monitoring.router_flush import routers_from_host, take_routers
from fp8track.monitoring.run_meta import (  # re-exported: the run metadata lived here before
    data_fingerprint,
    precision_setup,
    run_meta_for,
    select_eval_metrics,
    with_data,
)
from fp8track.monitoring.schedule import Sampler
from fp8track.monitoring.selection import Capture, LayerFilter, build_captures
from fp8track.monitoring.sharding import ShardSpec


class MonitorCore:
    """Watches a model's linear layers and writes FP8 diagnostics (see module docstring).

    Args:
        model: the model (hooks go on its linear-like layers).
        config: :class:`CaptureConfig`.
        layers: which layers (see :func:`fp8track.monitoring.selection.select_layers`).
        plans: per-layer :class:`LayerPlan` overrides keyed by fqn; other layers get
            :func:`fp8track.monitoring.plans.plan_for` (their backend's scales, or shadow mode
            for BF16 layers).
        log_dir: parent of the run directory (rank 0 writes ``<log_dir>/<run_id>``).
        sink: factory called with the run directory once it exists, returning the
            :class:`StepSink` fed after the records are written (the frontends pass the tracker
            fan-out); ``None`` writes the run directory only.
        meta: run metadata written to ``meta.json``.
        analyzers: rank-0 analysis components (:class:`StepAnalyzer`); the frontends
            (:class:`fp8track.Monitor`, the Lightning callback) plug in spikes, divergence and drift.
        is_writer: whether this process writes (default: global rank 0).
        sharding: the device mesh of a sharded run and its data-parallel dimensions
            (:class:`fp8track.monitoring.sharding.ShardSpec`, docs/sharding.md); ``None`` works
            for DDP, FSDP2 and DTensor tensor parallelism on one root mesh.
        apply_report: what :func:`fp8track.apply_fp8` returned for this model (its recipe and
            FP8/BF16 layer sets go into the run metadata); ``None``: the report of an
            ``apply_fp8`` call on the model, if any.
        data_fingerprint: what data the run saw, from :func:`data_fingerprint` (data seed, batch
            order hash); recorded as ``meta.config["data"]`` so the diagnosis compares two runs
            that saw the same batches step by step (:meth:`record_data` sets it later).
        grad_scaler: the ``torch.amp.GradScaler`` of an fp16 loop (:meth:`watch_grad_scaler`): a
            step it skipped (overflowed gradients, scale lowered, weights untouched) is a
            ``scaler_skip`` event, not a halt (:mod:`fp8track.monitoring.grad_scaler`).

    Logged metrics (per sampled step):
        ``fp8/loss`` (the un-normalised training loss, every step); ``fp8/<layer>/<tensor>/<stat>``
        for each stat in ``config.scalar_stats`` (units: ``_pct`` in percent of the finite
        elements, ``mse`` in squared tensor units,
        ``sqnr_db`` in dB, ``*_log2`` in binades); ``fp8/worst/<stat>`` (max over layers of
        underflow/overflow/mse/nonfinite, min of cos/sqnr_db, max |scale_drift_log2| as
        ``fp8/worst/abs_scale_drift_log2``); plus what analyzers add (``fp8/spikes/count``, ...).
    """

    def __init__(
        self,
        model: nn.Module,
        config: CaptureConfig | None = None,
        *,
        layers: str | Sequence[str] | LayerFilter | None = None,
        plans: Mapping[str, LayerPlan] | None = None,
        log_dir: str | Path | None = "fp8track-runs",
        sink: Callable[[Path], StepSink] | None = None,
        meta: RunMeta | None = None,
        analyzers: Sequence[StepAnalyzer] = (),
        is_writer: bool | None = None,
        sharding: ShardSpec | None = None,
        apply_report: ApplyReport | None = None,
        data_fingerprint: Mapping[str, Any] | None = None,
        grad_scaler: Any = None,
    ) -> None:
        self.model = model
        self.config = cfg = config or CaptureConfig()
        self.captures: dict[str, Capture]
        self.captures, self._te = build_captures(model, cfg, layers, dict(plans or {}), sharding)
        self.analyzers = list(analyzers)
        self.is_writer = (_dist_rank() == 0) if is_writer is None else is_writer
        self.apply_report = apply_report if apply_report is not None else applied_report(model)
        self.meta = meta or run_meta_for(model, report=self.apply_report)
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self._out = RunOutput(self.log_dir, sink)
        self.global_step = 0
        self._pending: list[PendingStep] = []
        self._closed = False
        self._attached = False
        self._was_attached = False
        self._told: set[str] = set()  # _warn_once keys already warned about
        self._resume_step: int | None = None  # set by load_state_dict: records from here on are redone
        self._sampler = Sampler(cfg.samples, cfg.burst_policy())
        self._post = FlushWriter(
            cfg, self.captures, self._sampler, self._out, self.apply_report, self.is_writer
        )
        self.grad_scaler: Any = None
        self.watch_grad_scaler(grad_scaler)
        if data_fingerprint is not None:
            self.record_data(data_fingerprint)

    # -- lifecycle -------------------------------------------------------------------------------
    @property
    def run_dir(self) -> Path | None:
        return self._out.run_dir

    @property
    def closed(self) -> bool:
        """True after :meth:`close`: the hooks are gone and the run directory is complete."""
        return self._closed

    @property
    def halt_reason(self) -> str | None:
        """Why the checkpoint guard stops training (:meth:`guard`), or None."""
        return self._post.guard.reason

    @property
    def fp8_flop_share(self) -> float | None:
        """The FP8 share of the GEMM FLOPs at the last fully sampled step (``fp8/fp8_flop_share``)."""
        return self._post.share.share

    @property
    def last_events(self) -> list[EventRecord]:
        """The events of the last flush with statistics rows (on the writer)."""
        return self._post.last_events

    def attach(self) -> MonitorCore:
        """Register hooks and (on the writer) open the run directory and trackers. Idempotent."""
        if self._attached:
            return self
        for cap in self.captures.values():
            cap.attach()
        if self.is_writer:
            self._out.open(self.meta, self._resume_step)
        self._attached = self._was_attached = True
        if self._te is not None:
            self._te.start(self.global_step)
        self.begin_step(self.global_step)
        return self

    def detach(self) -> None:
        """Remove the hooks (state, run directory and trackers stay open; :meth:`attach` re-adds)."""
        for cap in self.captures.values():
            cap.detach()
        self._attached = False

    def watch_grad_scaler(self, scaler: Any) -> None:
        """Read the loss scale of ``scaler`` (a ``torch.amp.GradScaler``, or None) after every step,
        so steps it skipped are told from poison. The Lightning callback passes its precision
        plugin's scaler.

        Raises:
            ConfigError: for anything but a ``GradScaler`` or None.
        """
        self.grad_scaler = check_grad_scaler(scaler)
        start = current_scale(self.grad_scaler)
        if start is not None and self._post.scaler.last is None:  # a resumed run keeps its own
            self._post.scaler.last = float(start)  # the scale before the first step (one host copy)

    def record_data(self, fingerprint: Mapping[str, Any]) -> None:
        """Record the data fingerprint (:func:`data_fingerprint`) in the run metadata, as
        ``meta.config["data"]``. Call before the first step: ``meta.json`` and the trackers' run
        configuration are written when the monitor attaches.

        Raises:
            ConfigError: after the run directory was opened, or for a fingerprint that is not a
                non-empty mapping of JSON scalars.
        """
        if self._out.writer is not None or self._attached:
            raise ConfigError(
                "record_data must be called before the monitor attaches (before the first step)"
            )
        self.meta = with_data(self.meta, fingerprint)

    @property
    def sampling(self) -> bool:
        """Whether the current step is sampled (frontends compute the grad norm only then)."""
        return self._sampler.sampled

    def begin_step(self, step: int) -> None:
        """Mark the start of optimizer step ``step`` (before its first forward)."""
        self.global_step = step
        if self._sampler.begin(step, self.captures):
            self._post.dumps.arm(step, self.captures)

    def step(
        self, loss: torch.Tensor | float | None = None, grad_norm: torch.Tensor | float | None = None
    ) -> None:
        """End the current optimizer step (plain-loop API): record, maybe flush, advance."""
        self.end_step(loss, grad_norm)
        self.begin_step(self.global_step)

    def end_step(
        self, loss: torch.Tensor | float | None = None, grad_norm: torch.Tensor | float | None = None
    ) -> None:
        """Record the step's loss (un-normalised, mean over micro-batches), flush if sampled, and
        advance the step counter (``global_step`` then names the next step, as Lightning's does).

        On an unsampled step only the loss is kept (on its device, no copy): no grad norm (a
        ``grad_norm`` passed in is dropped), no per-layer work, no device work.
        """
        if not self._attached:
            first = not self._was_attached
            self.attach()
            if first and self._sampler.sampled and self.captures:
                _warn_once(self._told, "late_attach", (
                    f"monitor.step() attached the monitor at the end of step {self.global_step}, so "
                    "that step's forward and backward ran unobserved (no statistics rows); call "
                    "monitor.attach(), or use `with fp8track.Monitor(...) as monitor:`, before the "
                    "first forward"))  # fmt: skip
        sampled = self._sampler.sampled
        if sampled and self.config.track_grad_norm and grad_norm is None:
            grad_norm = total_grad_norm(self.model)
            if grad_norm is None and any(p.requires_grad for p in self.model.parameters()):
                _warn_once(self._told, "no_gradients", (
                    f"no parameter had a gradient at monitor.step() (step {self.global_step}), so "
                    "fp8/grad_norm is not recorded and a non-finite gradient shows only later, in the "
                    "weights; call monitor.step() after optimizer.step() and before "
                    "optimizer.zero_grad(), or pass grad_norm="))  # fmt: skip
        gnorm = detached(grad_norm) if sampled else None  # an unsampled step keeps no grad norm
        scale = current_scale(self.grad_scaler)  # every step: a skip on an unsampled step is one too
        self._pending.append(PendingStep(self.global_step, detached(loss), gnorm, scale))
        if sampled:
            self.flush()
            self._sampler.end(self.captures)
        if self._te is not None:
            self._te.end_step()  # nvdlfw's iteration follows global_step (every rank calls it)
        self.global_step += 1

    def close(self, reduce: bool = True) -> None:
        """Flush what is pending, close analyzers, trackers and the run directory.

        ``reduce=False`` runs no collective (after an exception another rank may be dead or inside
        a different collective): the writer writes its own pending losses, not the ranks' mean.
        """
        if self._closed:
            return
        if self._pending:
            self.flush(with_stats=False, reduce=reduce)
        self.detach()
        if self._te is not None:
            self._te.close()
        if self.is_writer:
            self._out.finish(self.analyzers, last=max(self.global_step - 1, 0))
        self._closed = True

    # -- the flush: reduce, finalise, react, write ------------------------------------------------
    def flush(self, with_stats: bool = True, reduce: bool = True) -> None:
        """Reduce pending partials and losses across ranks (unless ``reduce`` is False: this rank's
        values only), then write on the writer rank.

        One job per step: take the captures' device partials (:func:`take_partials`, the routers'
        :func:`take_routers`), reduce them with the buffered losses and grad norms to the host
        (:func:`reduce_to_host`: one SUM and one MAX collective, one host copy), then on the writer
        :meth:`FlushWriter.write` (rows, analyzers, reactions, FLOP share, emission).
        """
        with collector_paused():  # its thousands of short-lived objects never meet a collection
            self._flush(with_stats, reduce)

    def _flush(self, with_stats: bool, reduce: bool) -> None:
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        take = take_partials(self.captures, device) if with_stats else DeviceTake()
        routers = take_routers(self.captures, device, take) if with_stats else []
        pending, self._pending = self._pending, []
        world = _dist_world() if reduce else 1
        timeout = self.config.collective_timeout_s
        host = reduce_to_host(take, pending, device, world=world, is_writer=self.is_writer, timeout_s=timeout)
        if host is not None:
            step = pending[-1].step if pending else self.global_step
            metrics = routers_from_host(routers, host.extra)
            self._post.write(step, take, pending, host, self.analyzers, with_stats, metrics)
        if with_stats and reduce and self.config.burst_steps and world > 1:
            share_burst(self._sampler.burst, device)

    def guard(self, parameters: bool = True) -> str | None:
        """Whether the run is safe to checkpoint now: ``None``, or why not (:attr:`halt_reason`, or
        a buffered non-finite loss, or with ``parameters`` a non-finite parameter; one device wait:
        :meth:`fp8track.monitoring.guard.CheckpointGuard.check`). Call it before saving a checkpoint
        (the Lightning callback does, in ``on_save_checkpoint``). This rank's view only: under DDP
        reduce the decision over ranks before acting on it."""
        # global_step names the next step: the weights checked are those after the last step ended
        last = max(self.global_step - 1, 0)
        return self._post.guard.check(self._pending, self.model, last, parameters)

    def _emit(
        self,
        step: int,
        metrics: dict[str, float],
        rows: Sequence[TensorStatsRow],
        events: Sequence[EventRecord],
        earlier: Sequence[tuple[int, dict[str, float]]] = (),
    ) -> None:
        """One logging step to the run directory, then to the trackers."""
        self._out.emit(step, metrics, rows, events, earlier=earlier)

    # -- evaluations -------------------------------------------------------------------------------
    def record_eval(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        """Record the validation/downstream metrics of one evaluation at optimizer step ``step`` as
        ``fp8/eval/<name>`` (``val/acc`` becomes ``fp8/eval/val/acc``), so the diagnosis compares
        them with the control's, not only the training loss. Values must already be reduced across
        ranks (Lightning's logged metrics are); non-numeric and non-finite values are skipped.
        Only the writer rank records. Returns what was recorded."""
        out = eval_metrics(metrics)
        if not self.is_writer or not out:
            return out
        if not self._attached:
            self.attach()
        self._emit(int(step), out, [], [])
        return out

    # -- checkpointing -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain data: step counter, losses not yet flushed, analyzer states, the burst."""
        return {
            "burst": self._sampler.burst.state_dict(),
            "scaler": self._post.scaler.state_dict(),
            "global_step": self.global_step,
            "pending": pending_state(self._pending),
            "run_id": self.meta.run_id,
            "analyzers": [a.state_dict() for a in self.analyzers],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict`; missing keys keep their current value."""
        self.global_step = int(state.get("global_step", self.global_step))
        if "pending" in state:
            self._pending = pending_from_state(state["pending"])
        if "run_id" in state and self._out.writer is None:
            # A resumed run appends to the run directory it started (readers keep the last value
            # of a step written twice: steps replayed after the checkpoint). What the run
            # directory holds from this step on came from a process that died after the
            # checkpoint: RunWriter drops it and the resumed run writes those steps once.
            self.meta = replace(self.meta, run_id=str(state["run_id"]))
            self._resume_step = min([p.step for p in self._pending] + [self.global_step])
        for a, s in zip(self.analyzers, state.get("analyzers", []), strict=False):
            a.load_state_dict(s)
        if "burst" in state:
            self._sampler.burst.load_state_dict(state["burst"])
        if "scaler" in state:
            self._post.scaler.load_state_dict(state["scaler"])



def _warn_once(told: set[str], key: str, message: str) -> None:
    """A ``UserWarning`` of ``message`` (prefixed ``fp8track:``) the first time ``key`` is told."""
    if key not in told:
        told.add(key)
        warn_user(f"fp8track: {message}")

__all__ = [
    "MonitorCore",
    "CaptureConfig",
    "StepAnalyzer",
    "StepSink",
    "DEFAULT_SCALAR_STATS",
    "DEFAULT_BURST_STEPS",
    "GUARD_ACTIONS",
    "WORST_MAX",
    "WORST_MIN",
    "FP8_SHARE_METRIC",
    "total_grad_norm",
    "precision_setup",
    "select_eval_metrics",
    "data_fingerprint",
    "run_meta_for",
]
