"""Framework-agnostic FP8 monitor: capture -> statistics -> rank reduction -> records -> trackers.

Plain PyTorch::

    monitor = Monitor(model, CaptureConfig(every_n_steps=10), log_dir="runs")
    for batch in loader:
        loss = model(batch).loss
        loss.backward(); opt.step()
        monitor.step(loss=loss)            # once per optimizer step, before zero_grad
        opt.zero_grad()
    monitor.close()

Per sampled step the hooks accumulate device-side partials; :meth:`Monitor.step` then does one
reduction across ranks (one SUM and one MAX collective for all layers, losses included), one
host copy, and on rank 0 alone writes the run directory and forwards the batch to trackers.
Losses of unsampled steps stay on the device until the next sampled step.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from fp8track.errors import ConfigError, check_float, check_int, invalid_choice
from fp8track.execution.apply import ApplyReport, applied_report
from fp8track.execution.backends import backend_of
from fp8track.monitoring import te_capture
from fp8track.monitoring.capture import (
    LayerCapture,
    LayerFilter,
    LayerPlan,
    plan_for,
    select_layers,
    validate_tensors,
    validate_whatif,
    variant_format,
)
from fp8track.monitoring.dumps import DumpBudget, DumpPolicy, LayerDump, observation, plan_dict, write_dump
from fp8track.monitoring.expert_capture import ExpertRowCapture, moe_captures, not_fp8_reason
from fp8track.monitoring.naming import LOSS_METRIC, metric_name, run_metric, worst_metric
from fp8track.monitoring.records import (
    EventRecord,
    MetricsRecord,
    RunMeta,
    RunWriter,
    StepBatch,
    TensorStatsRow,
)
from fp8track.monitoring.router_capture import RouterCapture, finalize_router, router_metrics
from fp8track.monitoring.run_meta import (  # re-exported: the run metadata lived here before
    data_fingerprint,
    precision_setup,
    run_meta_for,
    select_eval_metrics,
)
from fp8track.monitoring.schedule import (
    BURST_LAYERS,
    DEFAULT_BURST_TRIGGERS,
    Burst,
    BurstPolicy,
    normalise_windows,
    scheduled,
)
from fp8track.monitoring.sharding import ShardSpec, grad_sq_share, is_dtensor
from fp8track.numerics.formats import TENSOR_KINDS, get_format_pair
from fp8track.numerics.nvfp4 import BLOCK_RANGE_STAT
from fp8track.numerics.stats import NUM_SUM, PARTIAL_SIZE, STAT_NAMES, finalize_many

DEFAULT_SCALAR_STATS = (
    "underflow_pct",
    "overflow_pct",
    "mse",
    "cos",
    "sqnr_db",
    "amax",
    "scale",
    "scale_drift_log2",
    "nonfinite_pct",
)
# Worst over layers: these are worse when larger...
WORST_MAX = ("underflow_pct", "overflow_pct", "mse", "nonfinite_pct")
# ...and these when smaller.
WORST_MIN = ("cos", "sqnr_db")
GUARD_ACTIONS = ("stop", "log")
"""``on_nonfinite`` / ``on_divergence``: ``"stop"`` (the guard stops training before a checkpoint of
that step is written) or ``"log"`` (recorded only)."""
FP8_SHARE_METRIC = run_metric("fp8_flop_share")
DEFAULT_BURST_STEPS = 8
"""K, steps sampled after an event. A burst step of every layer costs 1.3x an unsampled step on the
example GPT (bench/results_burst.json), so a burst of 8 adds about 2.4 unsampled steps' worth of
time per event; 8 covers the spike detector's confirmation and recovery checks (2 + 3 steps) with
room for an intermittent fault to recur."""


@dataclass(frozen=True)
class CaptureConfig:
    """What to capture and how often. Validated at construction. The frontends take
    :class:`fp8track.MonitorConfig`, which adds the analysis thresholds to these fields.

    Attributes:
        every_n_steps: sample every N-th optimizer step (step % N == 0), N >= 1.
        steps: extra steps to sample, whatever N says.
        tensors: subset of ``("activation", "weight", "gradient")``.
        scalar_stats: statistics logged as per-layer scalars (all go to the tensor-stats table).
        whatif: extra recipes to evaluate on the same tensors (``"current"``, ``"mxfp8"``,
            ``"block"``, ``"nvfp4"``), table only; block ones add ``<name>_columnwise`` rows.
        per_layer_scalars: False logs per-layer detail to tables only (bounded metric count).
        shadow_format: format pair used to judge BF16 layers (``"hybrid"`` or ``"e4m3"``).
        track_grad_norm: compute the total gradient norm on sampled steps (for spike attribution).
        collective_timeout_s: the longest a rank waits for the others in fp8track's all-reduces
            before raising :class:`fp8track.errors.RankFailure` (a peer died or hangs).
        start_step, end_step: sample only between these steps (inclusive; ``end_step=None``: no
            end), as TE's debug API features (``steps`` are sampled whatever the window).
        start_end_list: ``[[start, end], ...]`` windows (inclusive), replacing start/end (TE).
        burst_steps: after an event (``burst_on``) sample every step of the next K steps, then go
            back to the schedule; 0 switches bursts off (:mod:`fp8track.monitoring.schedule`).
        burst_layers: ``"implicated"`` (the layers the event names; every layer for loss events)
            or ``"all"``.
        burst_on: event kinds that open a burst: ``spike``, ``nonfinite``, ``divergence`` (default)
            and ``drift`` (opt-in: frequent under delayed scaling).
        max_dumps: tensor dumps per run, each taken on the first burst step after an event, of the
            burst's layers (:mod:`fp8track.monitoring.dumps`); 0 switches dumps off.
        max_dump_bytes: bytes of tensors per dump (layers past it are left out and named).
        on_nonfinite: ``"stop"`` (default: a non-finite loss or gradient stops training before a
            checkpoint of that step is saved, :meth:`Monitor.guard`) or ``"log"``.
        on_divergence: ``"log"`` (default) or ``"stop"`` (a divergence onset stops training too).
        fp8_share_warn_below: with an FP8 recipe, warn at the first fully sampled step when less
            than this share of the GEMM FLOPs ran in FP8, naming the layers that did not and why.
    """

    every_n_steps: int = 10
    steps: tuple[int, ...] = ()
    tensors: tuple[str, ...] = TENSOR_KINDS
    scalar_stats: tuple[str, ...] = DEFAULT_SCALAR_STATS
    whatif: tuple[str, ...] = ()
    per_layer_scalars: bool = True
    shadow_format: str = "hybrid"
    track_grad_norm: bool = True
    collective_timeout_s: float = 600.0
    start_step: int = 0
    end_step: int | None = None
    start_end_list: tuple[tuple[int, int], ...] = ()
    burst_steps: int = DEFAULT_BURST_STEPS
    burst_layers: str = "implicated"
    burst_on: tuple[str, ...] = DEFAULT_BURST_TRIGGERS
    max_dumps: int = 2
    max_dump_bytes: int = 256 * 2**20
    on_nonfinite: str = "stop"
    on_divergence: str = "log"
    fp8_share_warn_below: float = 0.5

    def __post_init__(self) -> None:
        check_int("every_n_steps", self.every_n_steps, 1)
        check_int("start_step", self.start_step, 0)
        if self.end_step is not None:
            check_int("end_step", self.end_step, self.start_step)
        object.__setattr__(self, "start_end_list", normalise_windows(self.start_end_list))
        object.__setattr__(self, "burst_on", self.burst_policy().triggers)
        if self.burst_layers not in BURST_LAYERS:
            raise invalid_choice("burst_layers", self.burst_layers, BURST_LAYERS)
        self.dump_policy()
        for name in ("on_nonfinite", "on_divergence"):
            if getattr(self, name) not in GUARD_ACTIONS:
                raise invalid_choice(name, getattr(self, name), GUARD_ACTIONS)
        check_float("fp8_share_warn_below", self.fp8_share_warn_below, 0.0)
        if self.fp8_share_warn_below > 1:
            raise ConfigError(f"fp8_share_warn_below is a share in [0, 1], got {self.fp8_share_warn_below!r}")
        check_float("collective_timeout_s", self.collective_timeout_s, 0.0, strict=True)
        for s in self.steps:
            check_int("steps entry", s, 0)
        object.__setattr__(self, "steps", tuple(self.steps))
        object.__setattr__(self, "tensors", validate_tensors(self.tensors))
        object.__setattr__(self, "whatif", validate_whatif(self.whatif))
        stats = tuple(self.scalar_stats)
        for stat in stats:
            if stat not in STAT_NAMES:
                raise invalid_choice("statistic", stat, STAT_NAMES)
        object.__setattr__(self, "scalar_stats", stats)
        get_format_pair(self.shadow_format)

    def samples(self, step: int) -> bool:
        """Whether the fixed schedule samples ``step`` (bursts come on top, decided by the monitor)."""
        return scheduled(
            step, self.every_n_steps, self.steps, self.start_step, self.end_step, self.start_end_list
        )

    def burst_policy(self) -> BurstPolicy:
        return BurstPolicy(self.burst_steps, self.burst_layers, tuple(self.burst_on))

    def dump_policy(self) -> DumpPolicy:
        return DumpPolicy(self.max_dumps, self.max_dump_bytes)


class StepAnalyzer(Protocol):
    """Analysis run on rank 0 at each flush (spikes, drift, baseline gap...)."""

    def observe(
        self, losses: Sequence[tuple[int, float, float | None]], rows: Sequence[TensorStatsRow]
    ) -> tuple[dict[str, float], list[EventRecord]]: ...

    def close(self, last_step: int) -> list[EventRecord]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class StepSink(Protocol):
    """Where the writer rank sends each logging step after the run directory has it (the tracker
    fan-out of :mod:`fp8track.trackers`); built by a factory that receives the run directory.
    A sink whose ``coalesces`` attribute is true gets a flush's loss-only steps inside the logging
    step's batch (``StepBatch.earlier``, one call per flush); any other gets one batch per step."""

    def start(self, meta: RunMeta, recorded_before_resume: int | None = None) -> None: ...

    def log(self, batch: StepBatch) -> None: ...

    def finish(self) -> None: ...


def _dist_world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _dist_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@dataclass
class _PendingStep:
    step: int
    loss: torch.Tensor | None
    grad_norm: torch.Tensor | None


class Monitor:
    """Watches a model's linear layers and writes FP8 diagnostics (see module docstring).

    Args:
        model: the model (hooks go on its linear-like layers).
        config: :class:`CaptureConfig`.
        layers: which layers (see :func:`fp8track.monitoring.capture.select_layers`).
        plans: per-layer :class:`LayerPlan` overrides keyed by fqn; other layers get
            :func:`fp8track.monitoring.capture.plan_for` (their backend's scales, or shadow mode
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
    ) -> None:
        self.model = model
        self.config = cfg = config or CaptureConfig()
        plans = dict(plans or {})
        chosen = select_layers(model, layers)
        # Layer captures, and for MoE blocks the expert rows and routers (the same interface).
        self.captures: dict[str, LayerCapture | ExpertRowCapture | RouterCapture] = {}
        # Mixture-of-experts blocks: per-expert rows and router statistics (monitoring.expert_capture).
        moe = moe_captures(model, chosen, cfg.tensors, cfg.shadow_format)
        chosen = [(fqn, m) for fqn, m in chosen if fqn not in moe.skip]
        te_bound, te_unseen = [], []
        backends = {fqn: backend_of(m) for fqn, m in chosen}
        te_live = any(b is not None and b.debug_api for b in backends.values()) and te_capture.capture_live()
        for fqn, module in chosen:
            backend = backends[fqn]
            if backend is not None and backend.debug_api and te_live:
                caps = te_capture.gemm_captures(fqn, module, cfg.tensors, cfg.whatif, cfg.shadow_format)
                self.captures.update(caps)
                te_bound.append((fqn, module, caps))
                continue
            if backend is not None and not backend.hooks_see_gemms(module):
                te_unseen.append(fqn)  # ln_out, fc2's input, weight0..N: only TE's debug API sees them
                continue
            # Plans resolve at the first observation: backends build their state (TE's fp8_meta) lazily.
            plan = plans.get(fqn) or (lambda f=fqn, m=module: plan_for(f, m, cfg.shadow_format))
            self.captures[fqn] = LayerCapture(
                module, plan, cfg.tensors, cfg.whatif, sharding, collective_timeout_s=cfg.collective_timeout_s
            )
        self.captures.update(moe.captures)
        for fqn in moe.token_layers:  # MoE: module-list experts' rows carry their tokens
            if isinstance(cap := self.captures.get(fqn), LayerCapture):
                cap.count_tokens = True
        if te_unseen:
            warnings.warn(
                f"fp8track: {len(te_unseen)} TE layers ({', '.join(te_unseen[:4])}...) quantise tensors "
                "no module hook sees; call fp8track.monitoring.te_capture.initialize() before building "
                "the model to monitor them",
                stacklevel=2,
            )
        self._te = te_capture.TECapture(te_bound, cfg.every_n_steps, cfg.steps) if te_bound else None
        self.analyzers = list(analyzers)
        self.last_events: list[EventRecord] = []
        self._warned: set[str] = set()
        self.is_writer = (_dist_rank() == 0) if is_writer is None else is_writer
        self.apply_report = apply_report if apply_report is not None else applied_report(model)
        self.meta = meta or run_meta_for(model, report=self.apply_report)
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self._sink_factory = sink
        self._writer: RunWriter | None = None
        self._fanout: StepSink | None = None
        self.global_step = 0
        self._sampled = False
        self._layers_idle = False  # every layer known to be in the unsampled state
        self._pending: list[_PendingStep] = []
        self._closed = False
        self._attached = False
        self._resume_step: int | None = None  # set by load_state_dict: records from here on are redone
        self._burst = Burst(cfg.burst_policy())
        self._why: str | None = None  # "schedule" or "burst" on a sampled step
        self._full_sample = False  # every layer sampled this step (the FP8 FLOP share needs all)
        self._dumps_left = cfg.max_dumps
        self._dump_request: set[str] | None | bool = False  # False: none; None: all layers
        self._dump: tuple[DumpBudget, dict[str, LayerDump]] | None = None
        self.halt_reason: str | None = None
        self._halt_events: list[EventRecord] = []
        self.fp8_flop_share: float | None = None
        self._router_host: tuple[list[Any], list[float]] = ([], [])
        self._share_checked = False
        if data_fingerprint is not None:
            self.record_data(data_fingerprint)

    # -- lifecycle -------------------------------------------------------------------------------
    @property
    def run_dir(self) -> Path | None:
        return self._writer.run_dir if self._writer else None

    @property
    def closed(self) -> bool:
        """True after :meth:`close`: the hooks are gone and the run directory is complete."""
        return self._closed

    def attach(self) -> Monitor:
        """Register hooks and (on the writer) open the run directory and trackers. Idempotent."""
        if self._attached:
            return self
        for cap in self.captures.values():
            cap.attach()
        if self.is_writer and self.log_dir is not None and self._writer is None:
            self._writer = RunWriter.create(self.log_dir, self.meta, self._resume_step)
            if self._sink_factory is not None:
                self._fanout = self._sink_factory(self._writer.run_dir)
                self._fanout.start(self.meta, self._writer.recorded_before_resume)
        self._attached = True
        if self._te is not None:
            self._te.start(self.global_step)
        self.begin_step(self.global_step)
        return self

    def detach(self) -> None:
        """Remove the hooks (state, run directory and trackers stay open; :meth:`attach` re-adds)."""
        for cap in self.captures.values():
            cap.detach()
        self._attached = False

    def record_data(self, fingerprint: Mapping[str, Any]) -> None:
        """Record the data fingerprint (:func:`data_fingerprint`) in the run metadata, as
        ``meta.config["data"]``. Call before the first step: ``meta.json`` and the trackers' run
        configuration are written when the monitor attaches.

        Raises:
            ConfigError: after the run directory was opened, or for a fingerprint that is not a
                non-empty mapping of JSON scalars.
        """
        if self._writer is not None or self._attached:
            raise ConfigError(
                "record_data must be called before the monitor attaches (before the first step)"
            )
        if not isinstance(fingerprint, Mapping) or not fingerprint:
            raise ConfigError(f"data fingerprint must be a non-empty mapping, got {fingerprint!r}")
        bad = [k for k, v in fingerprint.items() if not isinstance(v, (str, int, float, bool, type(None)))]
        if bad:
            raise ConfigError(
                "data fingerprint values must be str/int/float/bool/None; "
                f"bad keys: {', '.join(map(str, bad))}"
            )
        self.meta = replace(self.meta, config={**dict(self.meta.config), "data": dict(fingerprint)})

    @property
    def sampling(self) -> bool:
        """Whether the current step is sampled (frontends compute the grad norm only then)."""
        return self._sampled

    def begin_step(self, step: int) -> None:
        """Mark the start of optimizer step ``step`` (before its first forward)."""
        self.global_step = step
        fixed = self.config.samples(step)
        burst = self._burst.active(step)
        sampled = fixed or burst
        # Layers change state only around sampled steps: an unsampled step after an unsampled
        # one does no per-layer work (no hooks are registered either).
        if sampled or self._sampled or not self._layers_idle:
            for fqn, cap in self.captures.items():
                cap.begin_step(fixed or self._burst.wants(step, fqn))
            self._layers_idle = not sampled
        self._sampled = sampled
        self._why = None if not sampled else ("schedule" if fixed else "burst")
        self._full_sample = fixed or (burst and self._burst.layers is None)
        if sampled and self._dump_request is not False:
            self._arm_dump(step)

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
            self.attach()
        if not self._sampled:
            self._pending.append(_PendingStep(self.global_step, _detached(loss), None))
            if self._te is not None:
                self._te.end_step()  # nvdlfw's iteration follows global_step (every rank calls it)
            self.global_step += 1
            return
        if self.config.track_grad_norm and grad_norm is None:
            grad_norm = total_grad_norm(self.model)
        self._pending.append(_PendingStep(self.global_step, _detached(loss), _detached(grad_norm)))
        self.flush()
        self._sampled = False
        for cap in self.captures.values():  # nothing is captured between steps (e.g. validation)
            cap.begin_step(False)
            cap.recorder = None
        if self._te is not None:
            self._te.end_step()  # nvdlfw's iteration follows global_step (every rank calls it)
        self._layers_idle = True
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
            events: list[EventRecord] = []
            last = max(self.global_step - 1, 0)
            for a in self.analyzers:
                events.extend(a.close(last))
            events.append(EventRecord("run_end", last, {}))
            self._emit(last, {}, [], events, write_metrics=False)
            if self._fanout is not None:
                self._fanout.finish()
            if self._writer is not None:
                self._writer.close()
        self._closed = True

    # -- the flush: reduce, finalize, write --------------------------------------------------------
    def _device(self) -> torch.device:
        for p in self.model.parameters():
            return p.device
        return torch.device("cpu")

    def flush(self, with_stats: bool = True, reduce: bool = True) -> None:
        """Reduce pending partials and losses across ranks (unless ``reduce`` is False: this rank's
        values only), then write on the writer rank.

        One job per step: :meth:`_take_partials` (the layers' device partials),
        :meth:`_reduce_to_host` (one SUM and one MAX collective, one host copy), :meth:`_finalise`
        (statistics rows, the steps that had a loss), :meth:`_analyse` (the analyzers),
        :meth:`_react` (bursts, dumps, the guard) and the FLOP share, then :meth:`_emit` once per
        buffered step with a loss and once for the logging step.
        """
        device = self._device()
        keys, parts = self._take_partials(device) if with_stats else ([], [])
        range_keys, ranges = self._take_ranges(device) if with_stats else ([], [])
        routers = self._take_routers(device) if with_stats else []
        router_sums = [torch.cat([r[1] for r in routers])] if routers else []
        router_max = [torch.cat([r[2] for r in routers])] if routers else []
        pending, self._pending = self._pending, []
        host = self._reduce_to_host(parts, pending, device, reduce, ranges, (router_sums, router_max))
        if host is not None:
            n_router = sum(r[1].numel() + r[2].numel() for r in routers)
            self._router_host = (routers, host[len(host) - n_router :])
            self._write_flush(keys, pending, host[: len(host) - n_router], with_stats, range_keys)
        if with_stats and reduce and self.config.burst_steps and _dist_world() > 1:
            self._share_burst(device)

    def _share_burst(self, device: torch.device) -> None:
        """Every rank samples the same steps and layers: the writer's burst (all layers under
        several ranks) is broadcast, one small collective per sampled step when bursts are on."""
        import torch.distributed as dist

        window = torch.tensor([self._burst.start, self._burst.until], dtype=torch.int64, device=device)
        dist.broadcast(window, src=0)
        self._burst.start, self._burst.until = (int(v) for v in window.tolist())
        self._burst.layers = None

    def _write_flush(
        self,
        keys: Sequence[tuple[str, str, str]],
        pending: Sequence[_PendingStep],
        host: Sequence[float],
        with_stats: bool,
        range_keys: Sequence[tuple[str, str, str]] = (),
    ) -> None:
        """The writer's part of a flush: finalise, analyse, react, emit."""
        step, rows, series, step_metrics = self._finalise(keys, pending, host, range_keys)
        # Every earlier step's loss goes to the records and the trackers under its own step number
        # (trackers then hold the loss of every optimizer step, not only of the sampled ones), in
        # the logging step's one tracker batch (one MLflow log_batch per flush, not per step).
        # A NaN loss is not written as a value: the analyzers' non-finite event records it.
        earlier = [
            (s, _loss_metrics(loss, gnorm)) for s, loss, gnorm in series if s != step and not math.isnan(loss)
        ]
        metrics, events = self._analyse(step, series, rows)
        events.extend(self._react(step, pending, host, keys, events, with_stats))
        metrics.update(self._flop_share(step, events) if with_stats else {})
        metrics.update(self._router_metrics())
        self.last_events = events
        self._emit(step, {**step_metrics, **self._scalars(rows), **metrics}, rows, events, earlier=earlier)

    # -- reacting to what a flush found: bursts, dumps, the guard --------------------------------
    def _react(
        self,
        step: int,
        pending: Sequence[_PendingStep],
        host: Sequence[float],
        keys: Sequence[tuple[str, str, str]],
        events: Sequence[EventRecord],
        with_stats: bool,
    ) -> list[EventRecord]:
        """The events this flush adds on the writer: why the step was sampled (a burst step), the
        burst an event opens, the tensor dump of the step, and the guard's decision."""
        out: list[EventRecord] = []
        if self._why == "burst" and with_stats:
            out.append(EventRecord("sampled", step, self._burst.reason(step)))
        if self._dump is not None:
            out.append(self._write_dump(step))
        opened = self._burst.open(step, events) if with_stats else None
        if opened is not None:
            out.append(opened)
            if self._dumps_left > 0 and self._writer is not None:
                self._dump_request = self._burst.layers
        reason = self._halt_for(pending, host, keys, events)
        if reason is not None and self.halt_reason is None:
            self.halt_reason = reason
            self._halt_events.append(EventRecord("halt", step, {"reason": reason}))
        out.extend(self._halt_events)
        self._halt_events = []
        return out

    def _halt_for(
        self,
        pending: Sequence[_PendingStep],
        host: Sequence[float],
        keys: Sequence[tuple[str, str, str]],
        events: Sequence[EventRecord],
    ) -> str | None:
        """Why training must stop after this flush (``on_nonfinite`` / ``on_divergence``), or None."""
        cfg = self.config
        if cfg.on_nonfinite == "stop":
            _, losses, gnorms, _ = _host_slices(host, len(keys), len(pending))
            for p, loss, g in zip(pending, losses, gnorms, strict=True):
                if p.loss is not None and not math.isfinite(loss):
                    return f"non-finite loss ({loss}) at step {p.step}"
                if p.grad_norm is not None and not math.isfinite(g):
                    return f"non-finite gradient norm ({g}) at step {p.step}"
        if cfg.on_divergence == "stop":
            for e in events:
                if e.kind == "divergence":
                    return f"divergence detected at step {e.step} ({e.data.get('reason', 'loss rising')})"
        return None

    def guard(self, parameters: bool = True) -> str | None:
        """Whether the run is safe to checkpoint now: ``None``, or why not. Call it before saving a
        checkpoint (the Lightning callback does, in ``on_save_checkpoint``).

        Besides what the flushes decided (:attr:`halt_reason`: a non-finite loss or gradient norm
        with ``on_nonfinite="stop"``, a divergence with ``on_divergence="stop"``), it checks the
        losses of the unsampled steps not yet flushed and, with ``parameters``, that every
        parameter is finite (a non-finite gradient on an unsampled step poisons the weights before
        any loss shows it). This waits for the device once (a checkpoint save waits anyway).
        This rank's view only: under DDP reduce the decision over ranks before acting on it.
        """
        if self.halt_reason is None and self.config.on_nonfinite == "stop":
            reason = _nonfinite_pending(self._pending) or (
                _nonfinite_parameters(self.model) if parameters else None
            )
            if reason is not None:
                self.halt_reason = reason
                self._halt_events.append(EventRecord("halt", self.global_step, {"reason": reason}))
        return self.halt_reason

    def _flop_share(self, step: int, events: list[EventRecord]) -> dict[str, float]:
        """The share of the GEMM FLOPs the hooks saw this step that ran in FP8 (a fully sampled
        step only), and the one-time warning when it is under ``fp8_share_warn_below``."""
        flops = {fqn: cap.take_flops() for fqn, cap in self.captures.items()}
        total = sum(flops.values())
        if not self._full_sample or total == 0:
            return {}
        fp8 = sum(f for fqn, f in flops.items() if self.captures[fqn].plan.fp8)
        self.fp8_flop_share = share = fp8 / total
        if not self._share_checked:
            self._share_checked = True
            events.extend(self._check_share(step, share, flops))
        return {FP8_SHARE_METRIC: share}

    def _check_share(self, step: int, share: float, flops: Mapping[str, int]) -> list[EventRecord]:
        report = self.apply_report
        asked = report.recipe.quantizes if report is not None else any(
            cap.plan.fp8 for cap in self.captures.values()
        )
        if not asked or share >= self.config.fp8_share_warn_below:
            return []
        why = _why_not_fp8(report)
        missing = [
            (fqn, why.get(fqn) or not_fp8_reason(self.captures[fqn], why)  # MoE: expert / router captures
             or "its backend runs it in high precision (not an FP8 layer)")
            for fqn, f in sorted(flops.items(), key=lambda kv: -kv[1])
            if f and not self.captures[fqn].plan.fp8
        ]
        text = (
            f"only {100 * share:.1f}% of the GEMM FLOPs ran in FP8 at step {step} "
            f"(warning below {100 * self.config.fp8_share_warn_below:.0f}%); not in FP8: "
            + "; ".join(f"{n} ({r})" for n, r in missing[:8])
            + (f"; and {len(missing) - 8} more" if len(missing) > 8 else "")
        )
        if self.is_writer:
            warnings.warn(f"fp8track: {text}", stacklevel=4)
        data = {"share": share, "layers": [n for n, _ in missing], "reasons": [r for _, r in missing],
                "alert": True, "level": "WARN", "title": "FP8 is off for much of the model", "text": text}
        return [EventRecord("fp8_share", step, data)]

    # -- tensor dumps --------------------------------------------------------------------------------
    def _arm_dump(self, step: int) -> None:
        """Dump the requested layers' observations of this sampled step (first step of a burst)."""
        wanted, self._dump_request = self._dump_request, False
        self._dumps_left -= 1
        budget = DumpBudget(self.config.max_dump_bytes)
        layers: dict[str, LayerDump] = {}
        for fqn, cap in self.captures.items():
            # (expert rows and routers keep no dumps: their tensors are grouped over experts)
            if isinstance(cap, LayerCapture) and cap.active and (wanted is None or fqn in wanted):  # type: ignore[operator]
                cap.recorder = self._recorder(fqn, cap, budget, layers, step)
        self._dump = (budget, layers)

    def _recorder(
        self, fqn: str, cap: LayerCapture, budget: DumpBudget, layers: dict[str, LayerDump], step: int
    ) -> Callable[[str, torch.Tensor, torch.Tensor | None], None]:
        def record(tensor: str, x: torch.Tensor, scale: torch.Tensor | None) -> None:
            plan = cap.plan
            per_tensor = plan.scaling == "per_tensor"
            nbytes = x.numel() * (x.element_size() + (1 if per_tensor and scale is not None else 0))
            if not budget.take(fqn, nbytes):
                layers.pop(fqn, None)  # a layer is dumped whole or not at all
                return
            dump = layers.setdefault(fqn, LayerDump(step, fqn, plan_dict(plan)))
            dump.observations.append(observation(tensor, x, scale, plan.formats[tensor], per_tensor))

        return record

    def _write_dump(self, step: int) -> EventRecord:
        assert self._dump is not None
        budget, layers = self._dump
        self._dump = None
        files, total = [], 0
        for dump in layers.values():
            if self._writer is None:
                break
            try:
                path, size = write_dump(self._writer.run_dir, dump)
            except OSError as exc:  # a full disk must not stop training
                warnings.warn(f"fp8track: tensor dump of {dump.layer} failed ({exc!r})", stacklevel=2)
                continue
            files.append(str(path.relative_to(self._writer.run_dir)))
            total += size
        return EventRecord(
            "dump", step, {"files": files, "bytes": total, "left_out": sorted(budget.refused)}
        )

    def _take_routers(self, device: torch.device) -> list[tuple[Any, torch.Tensor, torch.Tensor]]:
        """``(router capture, sums, max)`` of every MoE block's router this step (reset)."""
        routers = [cap for cap in self.captures.values() if isinstance(cap, RouterCapture)]
        return [(cap, cap.take_sums(device), cap.take_max(device)) for cap in routers]

    def _router_metrics(self) -> dict[str, float]:
        """The routers' metrics from this flush's host copy (:mod:`fp8track.monitoring.router_capture`)."""
        routers, host = self._router_host
        self._router_host = ([], [])
        if not routers:
            return {}
        n_sums = sum(r[1].numel() for r in routers)
        sums, maxes = host[:n_sums], host[n_sums:]
        per_block, i = {}, 0
        for j, (cap, s, _) in enumerate(routers):
            per_block[cap.name] = finalize_router(
                sums[i : i + s.numel()], maxes[j], cap.num_experts, cap.top_k
            )
            i += s.numel()
        return router_metrics(per_block)

    def _take_partials(self, device: torch.device) -> tuple[list[tuple[str, str, str]], list[torch.Tensor]]:
        """``(fqn, tensor, variant)`` keys and the device partials the layers accumulated since the
        last flush (the layers' accumulators are emptied)."""
        keys: list[tuple[str, str, str]] = []
        parts: list[torch.Tensor] = []
        for fqn, cap in self.captures.items():
            keys.extend((fqn, t, v) for t, v in cap.keys())
            parts.extend(cap.take(device))
        return keys, parts

    def _take_ranges(self, device: torch.device) -> tuple[list[tuple[str, str, str]], list[torch.Tensor]]:
        """``(fqn, tensor, variant)`` of the block rows and their ``max_blockwise_dynamic_range``
        this step (merged by max across ranks with the partials' max fields)."""
        keys: list[tuple[str, str, str]] = []
        ranges: list[torch.Tensor] = []
        for fqn, cap in self.captures.items():
            keys.extend((fqn, t, v) for t, v in cap.range_keys())
            ranges.extend(cap.take_ranges(device))
        return keys, ranges

    def _finalise(
        self,
        keys: Sequence[tuple[str, str, str]],
        pending: Sequence[_PendingStep],
        host: Sequence[float],
        range_keys: Sequence[tuple[str, str, str]] = (),
    ) -> tuple[int, list[TensorStatsRow], list[tuple[int, float, float | None]], dict[str, float]]:
        """From the host copy: the logging step, its statistics rows, ``(step, loss, grad norm)`` of
        the pending steps that had a loss, and the logging step's own loss / grad-norm metrics."""
        step = pending[-1].step if pending else self.global_step
        partials, losses, gnorms, block_ranges = _host_slices(host, len(keys), len(pending))
        rows = self._rows(step, keys, partials, dict(zip(range_keys, block_ranges, strict=True)))
        series = _loss_series(pending, losses, gnorms)
        metrics: dict[str, float] = {}
        if pending:  # the logging step's grad norm is recorded even when it was given no loss
            loss = losses[-1] if pending[-1].loss is not None and not math.isnan(losses[-1]) else None
            metrics = _loss_metrics(loss, None if math.isnan(gnorms[-1]) else gnorms[-1])
        return step, rows, series, metrics

    def _analyse(
        self, step: int, series: Sequence[tuple[int, float, float | None]], rows: Sequence[TensorStatsRow]
    ) -> tuple[dict[str, float], list[EventRecord]]:
        """Run every analyzer on this flush's losses and rows; one that raises becomes an
        ``analysis_error`` event (analysis must never stop training; the records keep the data)."""
        metrics: dict[str, float] = {}
        events: list[EventRecord] = []
        for a in self.analyzers:
            try:
                m, ev = a.observe(series, rows)
            except Exception as exc:
                self._analysis_failed(a, exc, step, events)
                continue
            metrics.update(m)
            events.extend(ev)
        return metrics, events

    def _reduce_to_host(
        self,
        parts: list[torch.Tensor],
        pending: Sequence[_PendingStep],
        device: torch.device,
        reduce: bool,
        ranges: Sequence[torch.Tensor] = (),
        extra: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] = ((), ()),
    ) -> list[float] | None:
        """The logging step's numbers on the host, reduced over ranks: the partials' fields, then
        the pending losses (mean over ranks), then their grad norms (root mean square over ranks,
        the global norm for sharded gradients, see :func:`total_grad_norm`). One SUM collective
        carries the partials' summed fields, the losses and the squared grad norms; one MAX
        collective the partials' max fields and the block rows' ``max_blockwise_dynamic_range``
        (``ranges``); ``extra`` (sums, maxima: the MoE routers' statistics) ride in the same two
        collectives and come last in the host copy, sums then maxima; then one host copy. ``None``
        on other ranks than the writer (they take part in the collectives only)."""
        extra_sums = torch.cat(list(extra[0])).to(torch.float64) if extra[0] else None
        extra_max = torch.cat(list(extra[1])).to(torch.float64) if extra[1] else None
        losses = _stack_or_nan([p.loss for p in pending], device).to(torch.float64)
        gnorms = _stack_or_nan([p.grad_norm for p in pending], device).to(torch.float64)
        stacked = (
            torch.stack(parts)
            if parts
            else torch.zeros((0, PARTIAL_SIZE), dtype=torch.float64, device=device)
        )
        block_ranges = (
            torch.stack(list(ranges)) if ranges else torch.zeros((0,), dtype=torch.float64, device=device)
        )
        world = _dist_world() if reduce else 1
        if world > 1:
            import torch.distributed as dist

            from fp8track.numerics.stats import wait_collectives

            n_extra = 0 if extra_sums is None else extra_sums.numel()
            n_extra_max = 0 if extra_max is None else extra_max.numel()
            sums = torch.cat([stacked[:, :NUM_SUM].reshape(-1),
                              *([extra_sums] if extra_sums is not None else []), losses, gnorms.square()])
            maxes = torch.cat([stacked[:, NUM_SUM:].reshape(-1), block_ranges,
                               *([extra_max] if extra_max is not None else [])])
            works = [dist.all_reduce(sums, op=dist.ReduceOp.SUM, async_op=True)]
            if maxes.numel():  # every rank has the same layers, so every rank skips it alike
                works.append(dist.all_reduce(maxes, op=dist.ReduceOp.MAX, async_op=True))
            # Bounded waits: a rank that died or hangs stops this one with a RankFailure.
            wait_collectives(works, self.config.collective_timeout_s, "the logging step's all-reduce")
            n_sum = stacked.shape[0] * NUM_SUM
            n_max = stacked.shape[0] * (PARTIAL_SIZE - NUM_SUM)
            stacked = torch.cat(
                [sums[:n_sum].reshape(-1, NUM_SUM), maxes[:n_max].reshape(-1, PARTIAL_SIZE - NUM_SUM)], dim=1
            )
            block_ranges = maxes[n_max : maxes.numel() - n_extra_max]
            if n_extra:
                extra_sums = sums[n_sum : n_sum + n_extra]
            if n_extra_max:
                extra_max = maxes[maxes.numel() - n_extra_max :]
            scalars = sums[n_sum + n_extra :] / world
            losses, gnorms = scalars[: len(pending)], scalars[len(pending) :].sqrt()
        if not self.is_writer:
            return None
        # The one host copy of this logging step.
        tail = [t for t in (extra_sums, extra_max) if t is not None]
        return torch.cat([stacked.reshape(-1), losses, gnorms, block_ranges, *tail]).cpu().tolist()

    def _analysis_failed(self, analyzer: Any, exc: Exception, step: int, events: list[EventRecord]) -> None:
        name = type(analyzer).__name__
        if name not in self._warned:
            self._warned.add(name)
            warnings.warn(f"fp8track: {name} failed at step {step} ({exc!r}); training goes on", stacklevel=2)
        events.append(EventRecord("analysis_error", step, {"analyzer": name, "error": repr(exc)}))

    def _rows(
        self,
        step: int,
        keys: Sequence[tuple[str, str, str]],
        flat: Sequence[float],
        ranges: Mapping[tuple[str, str, str], float] | None = None,
    ) -> list[TensorStatsRow]:
        live = []
        for i, key in enumerate(keys):
            part = flat[i * PARTIAL_SIZE : (i + 1) * PARTIAL_SIZE]
            if not (part[0] == 0 and part[NUM_SUM] == -math.inf):  # else nothing observed (an unused layer)
                live.append((key, part))
        if not live:
            return []
        plans = [self.captures[fqn].plan for (fqn, _, _), _ in live]
        fmts = [variant_format(plan, t, v) for plan, ((_, t, v), _) in zip(plans, live, strict=True)]
        stats = finalize_many([part for _, part in live], fmts, [plan.margin for plan in plans])
        for (key, _), st in zip(live, stats, strict=True):
            extra = getattr(self.captures[key[0]], "extra_stats", None)
            if extra is not None:  # expert rows: routed tokens
                extra(key[1], st)
            r = (ranges or {}).get(key, -math.inf)
            if r != -math.inf:  # a block row observed this step (TE's LogTensorStats statistic)
                st[BLOCK_RANGE_STAT] = r
        return [
            TensorStatsRow(step, fqn, tensor, s, variant)
            for ((fqn, tensor, variant), _), s in zip(live, stats, strict=True)
        ]

    def _scalars(self, rows: Sequence[TensorStatsRow]) -> dict[str, float]:
        out: dict[str, float] = {}
        main = [r for r in rows if r.variant in ("actual", "shadow")]
        if self.config.per_layer_scalars:
            # One expert's rows go to the tables only (E experts x layers would flood the scalars).
            for r in (r for r in main if getattr(self.captures.get(r.layer), "expert", None) is None):
                for s in self.config.scalar_stats:
                    out[metric_name(r.layer, r.tensor, s)] = r.stats[s]
        if main:
            for s in WORST_MAX:
                out[worst_metric(s)] = max(r.stats[s] for r in main)
            for s in WORST_MIN:
                out[worst_metric(s)] = min(r.stats[s] for r in main)
            out[worst_metric("abs_scale_drift_log2")] = max(abs(r.stats["scale_drift_log2"]) for r in main)
        return out

    def _emit(
        self,
        step: int,
        metrics: dict[str, float],
        rows: Sequence[TensorStatsRow],
        events: Sequence[EventRecord],
        write_metrics: bool = True,
        earlier: Sequence[tuple[int, dict[str, float]]] = (),
    ) -> None:
        """Write one logging step (and the loss-only ``earlier`` steps of its flush) to the run
        directory, then hand it to the trackers as one batch."""
        if self._writer is not None:
            for s, m in earlier:
                self._writer.write_metrics(MetricsRecord(s, m))
            if write_metrics and metrics:
                self._writer.write_metrics(MetricsRecord(step, metrics))
            self._writer.write_tensor_stats(rows)
            self._writer.write_events(events)
        if self._fanout is not None:
            batch = StepBatch(step, metrics, tuple(rows), tuple(events), tuple(earlier))
            # A sink that does not say it takes a batch's earlier steps gets one batch per step.
            for b in [batch] if getattr(self._fanout, "coalesces", False) else batch.split():
                self._fanout.log(b)

    # -- evaluations -------------------------------------------------------------------------------
    def record_eval(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        """Record the validation/downstream metrics of one evaluation at optimizer step ``step`` as
        ``fp8/eval/<name>`` (``val/acc`` becomes ``fp8/eval/val/acc``), so the diagnosis compares
        them with the control's, not only the training loss. Values must already be reduced across
        ranks (Lightning's logged metrics are); non-numeric and non-finite values are skipped.
        Only the writer rank records. Returns what was recorded."""
        out: dict[str, float] = {}
        for name, value in metrics.items():
            try:
                v = float(value)
            except (TypeError, ValueError, RuntimeError):
                continue
            if math.isfinite(v):
                out[run_metric("eval", *str(name).split("/"))] = v
        if not self.is_writer or not out:
            return out
        if not self._attached:
            self.attach()
        self._emit(int(step), out, [], [])
        return out

    # -- checkpointing -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain data: step counter, losses not yet flushed, analyzer states, the burst."""
        pending = [(p.step, _to_float(p.loss), _to_float(p.grad_norm)) for p in self._pending]
        return {
            "burst": self._burst.state_dict(),
            "global_step": self.global_step,
            "pending": pending,
            "run_id": self.meta.run_id,
            "analyzers": [a.state_dict() for a in self.analyzers],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict`; missing keys keep their current value."""
        self.global_step = int(state.get("global_step", self.global_step))
        if "run_id" in state and self._writer is None:
            # A resumed run appends to the run directory it started (readers keep the last value
            # of a step written twice: steps replayed after the checkpoint).
            self.meta = replace(self.meta, run_id=str(state["run_id"]))
        if "pending" in state:
            self._pending = [
                _PendingStep(s, _tensor_or_none(loss), _tensor_or_none(g)) for s, loss, g in state["pending"]
            ]
        if "run_id" in state and self._writer is None:
            # What the run directory holds from this step on came from a process that died after
            # the checkpoint: RunWriter drops it and the resumed run writes those steps once.
            self._resume_step = min([p.step for p in self._pending] + [self.global_step])
        for a, s in zip(self.analyzers, state.get("analyzers", []), strict=False):
            a.load_state_dict(s)
        if "burst" in state:
            self._burst.load_state_dict(state["burst"])


def _why_not_fp8(report: ApplyReport | None) -> dict[str, str]:
    """Layer -> why it is not in FP8, from :func:`fp8track.apply_fp8`'s report (the fallback
    spec's reason, the backend's shape guard, a module no backend converts)."""
    if report is None:
        return {}
    out = {n: f"kept in BF16: {r}" for n, r in report.bf16_layers}
    out.update({n: f"unsupported module: {r}" for n, r in report.unconverted})
    return out


def _nonfinite_pending(pending: Sequence[_PendingStep]) -> str | None:
    """The first buffered step whose loss is non-finite (one device wait), or None."""
    given = [p for p in pending if p.loss is not None]
    if not given:
        return None
    ok = torch.isfinite(torch.stack([p.loss.to(given[0].loss.device) for p in given])).tolist()  # type: ignore[union-attr]
    for p, fine in zip(given, ok, strict=True):
        if not fine:
            return f"non-finite loss ({float(p.loss)}) at step {p.step}"  # type: ignore[arg-type]
    return None


def _nonfinite_parameters(model: nn.Module) -> str | None:
    """Names the parameters holding NaN or inf (one device wait), or None when all are finite."""
    named = [(n, p) for n, p in model.named_parameters() if p.is_floating_point() and p.numel()]
    if not named:
        return None
    norms = torch._foreach_norm([(p.to_local() if is_dtensor(p) else p).detach() for _, p in named])
    flags = torch.stack([torch.isfinite(v.to(norms[0].device)) for v in norms]).tolist()
    bad = [n for (n, _), fine in zip(named, flags, strict=True) if not fine]
    if not bad:
        return None
    return f"non-finite parameters after step: {', '.join(bad[:4])}" + (" ..." if len(bad) > 4 else "")


def _loss_series(
    pending: Sequence[_PendingStep], losses: Sequence[float], gnorms: Sequence[float]
) -> list[tuple[int, float, float | None]]:
    """``(step, loss, grad norm or None)`` of the pending steps that had a loss. A step given no
    loss (manual optimisation returning nothing, ``step()`` without ``loss=``) has none: no
    record, nothing for the analyzers, so no false non-finite alarm. A NaN loss that was given is
    kept (it is the problem the analyzers look for)."""
    return [
        (p.step, losses[i], None if math.isnan(gnorms[i]) else gnorms[i])
        for i, p in enumerate(pending)
        if p.loss is not None
    ]


def _loss_metrics(loss: float | None, grad_norm: float | None) -> dict[str, float]:
    out = {LOSS_METRIC: loss} if loss is not None else {}
    if grad_norm is not None:
        out[run_metric("grad_norm")] = grad_norm
    return out


def _detached(v: torch.Tensor | float | None) -> torch.Tensor | None:
    if v is None:
        return None
    if isinstance(v, torch.Tensor):
        return v.detach().reshape(()).to(torch.float32)
    return torch.tensor(float(v), dtype=torch.float32)


def _to_float(v: torch.Tensor | None) -> float | None:
    return None if v is None else float(v)


def _tensor_or_none(v: float | None) -> torch.Tensor | None:
    return None if v is None else torch.tensor(v, dtype=torch.float32)


def _host_slices(
    host: Sequence[float], n_keys: int, n_pending: int
) -> tuple[Sequence[float], Sequence[float], Sequence[float], Sequence[float]]:
    """A flush's host copy cut as :meth:`Monitor._reduce_to_host` lays it out: the partials'
    fields, the pending steps' losses, their grad norms, the block rows' dynamic ranges."""
    n, m = n_keys * PARTIAL_SIZE, n_pending
    return host[:n], host[n : n + m], host[n + m : n + 2 * m], host[n + 2 * m :]


def _stack_or_nan(values: Sequence[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    if not values:
        return torch.zeros(0, dtype=torch.float32, device=device)
    nan = torch.full((), math.nan, dtype=torch.float32, device=device)  # a fill, not a host copy
    return torch.stack([nan if v is None else v.to(device) for v in values])


def total_grad_norm(model: nn.Module) -> torch.Tensor | None:
    """L2 norm of all parameter gradients as a device tensor (no host sync, no collective); None
    without grads.

    Sharded gradients (DTensors: FSDP2, tensor parallelism): this rank's *contribution*
    ``sqrt(world * share)``, where the shares (:func:`fp8track.monitoring.sharding.grad_sq_share`) sum
    to the squared global norm over the world; :meth:`Monitor.flush` reduces grad norms to their
    root mean square over ranks, which is then the global norm (and leaves a norm that is the same
    on every rank, as under DDP, unchanged).
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return None
    if any(is_dtensor(g) for g in grads):
        sq = grad_sq_share(model)
        return None if sq is None else (sq * _dist_world()).sqrt()
    norms = torch._foreach_norm(grads)
    return torch.linalg.vector_norm(torch.stack([n.to(torch.float32) for n in norms]))


__all__ = [
    "Monitor",
    "CaptureConfig",
    "StepAnalyzer",
    "StepSink",
    "DEFAULT_SCALAR_STATS",
    "GUARD_ACTIONS",
    "FP8_SHARE_METRIC",
    "precision_setup",
    "select_eval_metrics",
    "data_fingerprint",
]
