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
from collections.abc import Callable, Iterable, Mapping, Sequence
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
from fp8track.monitoring.naming import LOSS_METRIC, metric_name, run_metric, worst_metric
from fp8track.monitoring.records import (
    EventRecord,
    MetricsRecord,
    RunMeta,
    RunWriter,
    StepBatch,
    TensorStatsRow,
)
from fp8track.monitoring.sharding import ShardSpec, grad_sq_share, is_dtensor
from fp8track.numerics.formats import TENSOR_KINDS, get_format_pair
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

    def __post_init__(self) -> None:
        check_int("every_n_steps", self.every_n_steps, 1)
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
        return step % self.every_n_steps == 0 or step in self.steps


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
    fan-out of :mod:`fp8track.trackers`); built by a factory that receives the run directory."""

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
        self.captures: dict[str, LayerCapture] = {}
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
        sampled = self.config.samples(step)
        # Layers change state only around sampled steps: an unsampled step after an unsampled
        # one does no per-layer work (no hooks are registered either).
        if sampled or self._sampled or not self._layers_idle:
            for cap in self.captures.values():
                cap.begin_step(sampled)
            self._layers_idle = not sampled
        self._sampled = sampled

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
        (statistics rows, the steps that had a loss), :meth:`_analyse` (the analyzers), then
        :meth:`_emit` once per buffered step with a loss and once for the logging step.
        """
        device = self._device()
        keys, parts = self._take_partials(device) if with_stats else ([], [])
        pending, self._pending = self._pending, []
        host = self._reduce_to_host(parts, pending, device, reduce)
        if host is None:
            return
        step, rows, series, step_metrics = self._finalise(keys, pending, host)
        # Every earlier step's loss goes to the records and the trackers under its own step number
        # (trackers then hold the loss of every optimizer step, not only of the sampled ones).
        # A NaN loss is not written as a value: the analyzers' non-finite event records it.
        for s, loss, gnorm in series:
            if s != step and not math.isnan(loss):
                self._emit(s, _loss_metrics(loss, gnorm), [], [])
        metrics, events = self._analyse(step, series, rows)
        self.last_events = events
        self._emit(step, {**step_metrics, **self._scalars(rows), **metrics}, rows, events)

    def _take_partials(self, device: torch.device) -> tuple[list[tuple[str, str, str]], list[torch.Tensor]]:
        """``(fqn, tensor, variant)`` keys and the device partials the layers accumulated since the
        last flush (the layers' accumulators are emptied)."""
        keys: list[tuple[str, str, str]] = []
        parts: list[torch.Tensor] = []
        for fqn, cap in self.captures.items():
            keys.extend((fqn, t, v) for t, v in cap.keys())
            parts.extend(cap.take(device))
        return keys, parts

    def _finalise(
        self, keys: Sequence[tuple[str, str, str]], pending: Sequence[_PendingStep], host: Sequence[float]
    ) -> tuple[int, list[TensorStatsRow], list[tuple[int, float, float | None]], dict[str, float]]:
        """From the host copy: the logging step, its statistics rows, ``(step, loss, grad norm)`` of
        the pending steps that had a loss, and the logging step's own loss / grad-norm metrics."""
        n = len(keys) * PARTIAL_SIZE
        step = pending[-1].step if pending else self.global_step
        rows = self._rows(step, keys, host[:n])
        losses, gnorms = host[n : n + len(pending)], host[n + len(pending) :]
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
    ) -> list[float] | None:
        """The logging step's numbers on the host, reduced over ranks: the partials' fields, then
        the pending losses (mean over ranks), then their grad norms (root mean square over ranks,
        the global norm for sharded gradients, see :func:`total_grad_norm`). One SUM collective
        carries the partials' summed fields, the losses and the squared grad norms; one MAX
        collective the partials' max fields; then one host copy. ``None`` on other ranks than the
        writer (they take part in the collectives only)."""
        losses = _stack_or_nan([p.loss for p in pending], device).to(torch.float64)
        gnorms = _stack_or_nan([p.grad_norm for p in pending], device).to(torch.float64)
        stacked = (
            torch.stack(parts)
            if parts
            else torch.zeros((0, PARTIAL_SIZE), dtype=torch.float64, device=device)
        )
        world = _dist_world() if reduce else 1
        if world > 1:
            import torch.distributed as dist

            from fp8track.numerics.stats import wait_collectives

            sums = torch.cat([stacked[:, :NUM_SUM].reshape(-1), losses, gnorms.square()])
            maxes = stacked[:, NUM_SUM:].contiguous()
            works = [dist.all_reduce(sums, op=dist.ReduceOp.SUM, async_op=True)]
            if maxes.numel():  # every rank has the same layers, so every rank skips it alike
                works.append(dist.all_reduce(maxes, op=dist.ReduceOp.MAX, async_op=True))
            # Bounded waits: a rank that died or hangs stops this one with a RankFailure.
            wait_collectives(works, self.config.collective_timeout_s, "the logging step's all-reduce")
            n_sum = stacked.shape[0] * NUM_SUM
            stacked = torch.cat([sums[:n_sum].reshape(-1, NUM_SUM), maxes], dim=1)
            scalars = sums[n_sum:] / world
            losses, gnorms = scalars[: len(pending)], scalars[len(pending) :].sqrt()
        if not self.is_writer:
            return None
        # The one host copy of this logging step.
        return torch.cat([stacked.reshape(-1), losses, gnorms]).cpu().tolist()

    def _analysis_failed(self, analyzer: Any, exc: Exception, step: int, events: list[EventRecord]) -> None:
        name = type(analyzer).__name__
        if name not in self._warned:
            self._warned.add(name)
            warnings.warn(f"fp8track: {name} failed at step {step} ({exc!r}); training goes on", stacklevel=2)
        events.append(EventRecord("analysis_error", step, {"analyzer": name, "error": repr(exc)}))

    def _rows(
        self, step: int, keys: Sequence[tuple[str, str, str]], flat: Sequence[float]
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
        return [
            TensorStatsRow(step, fqn, tensor, s, variant)
            for ((fqn, tensor, variant), _), s in zip(live, stats, strict=True)
        ]

    def _scalars(self, rows: Sequence[TensorStatsRow]) -> dict[str, float]:
        out: dict[str, float] = {}
        main = [r for r in rows if r.variant in ("actual", "shadow")]
        if self.config.per_layer_scalars:
            for r in main:
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
    ) -> None:
        if self._writer is not None:
            if write_metrics and metrics:
                self._writer.write_metrics(MetricsRecord(step, metrics))
            self._writer.write_tensor_stats(rows)
            self._writer.write_events(events)
        if self._fanout is not None:
            self._fanout.log(StepBatch(step, metrics, tuple(rows), tuple(events)))

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
        """Plain data: step counter, losses not yet flushed, analyzer states."""
        pending = [(p.step, _to_float(p.loss), _to_float(p.grad_norm)) for p in self._pending]
        return {
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


def run_meta_for(
    model: nn.Module,
    name: str = "fp8track",
    config: Mapping[str, Any] | None = None,
    report: ApplyReport | None = None,
) -> RunMeta:
    """Run metadata for ``model``: the recipe and FP8/BF16 layer sets of ``report`` (else of an
    :func:`fp8track.apply_fp8` call on the model or a submodule, if any), plus ``config``."""
    report = report if report is not None else applied_report(model)
    config = {"precision": precision_setup(model, report=report), **dict(config or {})}
    if report is None:
        return RunMeta(name=name, config=config)
    return RunMeta(
        name=name,
        recipe=report.recipe.to_dict(),
        fp8_layers=tuple(report.fp8_layers),
        bf16_layers=tuple(n for n, _ in report.bf16_layers),
        config={**config, "apply": report.to_dict()},
    )


EVAL_NAME_PREFIXES = ("val", "valid", "eval", "test", "downstream")
"""Logged metric names that count as evaluation metrics by default (:func:`select_eval_metrics`)."""


def select_eval_metrics(logged: Mapping[str, Any], names: str | Sequence[str] = "auto") -> dict[str, Any]:
    """The evaluation metrics among ``logged`` (e.g. Lightning's ``trainer.callback_metrics`` at
    validation end): ``names`` itself when a list (missing ones are skipped), or for ``"auto"``
    every name whose first word is one of :data:`EVAL_NAME_PREFIXES` (``val_loss``, ``val/acc``,
    ``eval_accuracy``, ``test_f1``...)."""
    if names != "auto":
        return {n: logged[n] for n in names if n in logged}
    out = {}
    for name, value in logged.items():
        head = str(name).lower().replace("/", "_").split("_")[0]
        if head in EVAL_NAME_PREFIXES:
            out[name] = value
    return out


def precision_setup(
    model: nn.Module, optimizers: Sequence[Any] = (), report: ApplyReport | None = None, **extra: Any
) -> dict[str, Any]:
    """What the run enabled around precision, as read from the model and its optimizers, so a
    diagnosis can list what the FP8 run newly enabled relative to its control.

    Keys: ``recipe`` (name, from :func:`fp8track.apply_fp8`'s report, else ``None``),
    ``fp8_weights`` (a parameter is stored in an FP8 dtype or an FP8 tensor subclass),
    ``activation_checkpointing`` (a checkpoint wrapper module or a Hugging Face model with
    gradient checkpointing on), ``torch_compile`` (a compiled module), ``fused_optimizer``
    (``"fused"``/``"foreach"``/``None``), plus ``extra`` (the frontends add ``precision_plugin``,
    ``precision``, ``strategy``, ``cpu_offloading``).
    """
    fp8_dtypes = {
        getattr(torch, n)
        for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
        if hasattr(torch, n)
    }
    report = report if report is not None else applied_report(model)
    fp8_weights = any(
        p.dtype in fp8_dtypes or "float8" in type(p.data).__name__.lower() for p in model.parameters()
    )
    checkpointing = any(
        "checkpointwrapper" in type(m).__name__.lower() or getattr(m, "is_gradient_checkpointing", False)
        for m in model.modules()
    )
    compiled = any(
        type(m).__name__ == "OptimizedModule" or getattr(m, "_compiled_call_impl", None) is not None
        for m in model.modules()
    )
    fused = None
    for opt in optimizers:
        defaults = getattr(opt, "defaults", {}) or {}
        if defaults.get("fused"):
            fused = "fused"
        elif defaults.get("foreach") and fused is None:
            fused = "foreach"
    out = {
        "recipe": str(report.recipe) if report is not None else None,
        "fp8_weights": fp8_weights,
        "activation_checkpointing": checkpointing,
        "torch_compile": compiled,
        "fused_optimizer": fused,
    }
    out.update(extra)
    return out


def data_fingerprint(
    seed: int | None = None, order: Iterable[Any] | None = None, **extra: Any
) -> dict[str, Any]:
    """What data a run saw, for :class:`Monitor`'s ``data_fingerprint``: two runs whose
    fingerprints are equal saw the same batches in the same order, and their losses compare step
    by step (:func:`fp8track.analysis.loss_gap.same_batches`).

    Args:
        seed: the data seed (shuffling, sampling).
        order: the sample indices (or batch ids) in the order the run consumes them, e.g.
            ``list(sampler)`` for the first epoch; hashed (SHA-256 of their ``repr``), so a long
            order costs 64 characters in the metadata. Tensors are hashed from their values.
        extra: other JSON scalars that identify the data (dataset name, sequence length).

    Raises:
        ConfigError: when neither ``seed`` nor ``order`` is given.

    Example:
        >>> data_fingerprint(seed=0, order=[2, 0, 1])["n_order"]
        3
    """
    import hashlib

    if seed is None and order is None:
        raise ConfigError("data_fingerprint needs the data seed, the batch order, or both")
    out: dict[str, Any] = {}
    if seed is not None:
        out["seed"] = int(seed)
    if order is not None:
        h = hashlib.sha256()
        n = 0
        for item in order:
            value = item.detach().cpu().tolist() if isinstance(item, torch.Tensor) else item
            h.update(repr(value).encode())
            h.update(b"\x00")
            n += 1
        out["order_sha256"] = h.hexdigest()
        out["n_order"] = n
    out.update(extra)
    return out


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
    "precision_setup",
    "select_eval_metrics",
    "data_fingerprint",
]
