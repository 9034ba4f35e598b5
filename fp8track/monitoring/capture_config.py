"""What the monitor captures and how often (:class:`CaptureConfig`), and the two interfaces it
calls on the writer rank: :class:`StepAnalyzer` (analysis at each flush) and :class:`StepSink` (where
each logging step goes after the run directory has it). The frontends take
:class:`fp8track.MonitorConfig`, which adds the analysis thresholds to :class:`CaptureConfig`."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from fp8track.errors import ConfigError, FromDict, as_names, check_float, check_int, invalid_choice
from fp8track.monitoring.dumps import DumpPolicy
from fp8track.monitoring.plans import WHATIF_VARIANTS
from fp8track.monitoring.records import EventRecord, RunMeta, StepBatch, TensorStatsRow
from fp8track.monitoring.schedule import (
    BURST_LAYERS,
    DEFAULT_BURST_BUDGET,
    DEFAULT_BURST_TRIGGERS,
    DEFAULT_BURST_WINDOW,
    BurstPolicy,
    normalise_windows,
    scheduled,
)
from fp8track.numerics.formats import TENSOR_KINDS, get_format_pair
from fp8track.numerics.stats import STAT_NAMES

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
DEFAULT_BURST_STEPS = 8
"""K, steps sampled after an event. A burst step of every layer costs 1.3x an unsampled step on the
example GPT (bench/results_burst.json), so a burst of 8 adds about 2.4 unsampled steps' worth of
time per event; 8 covers the spike detector's confirmation and recovery checks (2 + 3 steps) with
room for an intermittent fault to recur."""


def validate_tensors(tensors: Iterable[str]) -> tuple[str, ...]:
    tensors = as_names(tensors)  # "activation" is ("activation",), not its letters
    if not tensors:
        raise ConfigError(f"tensors must name at least one of {TENSOR_KINDS}")
    for t in tensors:
        if t not in TENSOR_KINDS:
            raise invalid_choice("tensor kind", t, TENSOR_KINDS)
    return tensors


def validate_whatif(whatif: Iterable[str]) -> tuple[str, ...]:
    whatif = as_names(whatif)  # "mxfp8" is ("mxfp8",)
    for v in whatif:
        if v not in WHATIF_VARIANTS:
            raise invalid_choice("what-if variant", v, WHATIF_VARIANTS)
    return whatif


@dataclass(frozen=True)
class CaptureConfig(FromDict):
    """What to capture and how often. Validated at construction. The frontends take
    :class:`fp8track.MonitorConfig`, which adds the analysis thresholds to these fields. A list
    field given one bare string (``tensors: activation`` in YAML) holds that one name.

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
        burst_budget, burst_window: bursts sample at most this share (default 0.25) of any
            ``burst_window`` (default 100) consecutive steps, so recurring events cannot turn the
            schedule into every step (:mod:`fp8track.monitoring.schedule`).
        max_dumps: tensor dumps per run, each taken on the first burst step after an event, of the
            burst's layers (:mod:`fp8track.monitoring.dumps`); 0 switches dumps off.
        max_dump_bytes: bytes of tensors per dump (layers past it are left out and named).
        on_nonfinite: ``"stop"`` (default: a non-finite loss or gradient stops training before a
            checkpoint of that step is saved, :meth:`MonitorCore.guard`) or ``"log"``.
        on_divergence: ``"log"`` (default) or ``"stop"`` (a divergence onset stops training too).
        min_loss_scale: under fp16 with a ``GradScaler``, a loss scale that skipped steps drive
            below this (default 1e-4, fairseq's) is a collapse: a ``scaler_collapse`` event, and a
            halt with ``on_nonfinite="stop"`` (:mod:`fp8track.monitoring.grad_scaler`).
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
    burst_budget: float = DEFAULT_BURST_BUDGET
    burst_window: int = DEFAULT_BURST_WINDOW
    max_dumps: int = 2
    max_dump_bytes: int = 256 * 2**20
    on_nonfinite: str = "stop"
    on_divergence: str = "log"
    min_loss_scale: float = 1e-4
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
        check_float("min_loss_scale", self.min_loss_scale, 0.0, strict=True)
        if self.fp8_share_warn_below > 1:
            raise ConfigError(f"fp8_share_warn_below is a share in [0, 1], got {self.fp8_share_warn_below!r}")
        check_float("collective_timeout_s", self.collective_timeout_s, 0.0, strict=True)
        for s in self.steps:
            check_int("steps entry", s, 0)
        object.__setattr__(self, "steps", tuple(self.steps))
        object.__setattr__(self, "tensors", validate_tensors(self.tensors))
        object.__setattr__(self, "whatif", validate_whatif(self.whatif))
        stats = as_names(self.scalar_stats)  # a bare string is one statistic
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
        return BurstPolicy(
            self.burst_steps, self.burst_layers, as_names(self.burst_on), self.burst_budget, self.burst_window
        )

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


def run_analyzers(
    analyzers: Sequence[StepAnalyzer],
    step: int,
    series: Sequence[tuple[int, float, float | None]],
    rows: Sequence[TensorStatsRow],
    warned: set[str],
) -> tuple[dict[str, float], list[EventRecord]]:
    """Every analyzer on one flush's losses and rows. One that raises becomes an
    ``analysis_error`` event (analysis must never stop training; the records keep the data) and a
    warning, once per analyzer type (``warned`` remembers which)."""
    metrics: dict[str, float] = {}
    events: list[EventRecord] = []
    for a in analyzers:
        try:
            m, ev = a.observe(series, rows)
        except Exception as exc:
            name = type(a).__name__
            if name not in warned:
                warned.add(name)
                warnings.warn(
                    f"fp8track: {name} failed at step {step} ({exc!r}); training goes on", stacklevel=4
                )
            events.append(EventRecord("analysis_error", step, {"analyzer": name, "error": repr(exc)}))
            continue
        metrics.update(m)
        events.extend(ev)
    return metrics, events


__all__ = [
    "run_analyzers",
    "CaptureConfig",
    "StepAnalyzer",
    "StepSink",
    "DEFAULT_SCALAR_STATS",
    "DEFAULT_BURST_STEPS",
    "GUARD_ACTIONS",
    "WORST_MAX",
    "WORST_MIN",
]
