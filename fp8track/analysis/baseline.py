"""The control (baseline) run: load its loss curve, align it by step, compare spikes.

A reference names the control in one of three forms (:func:`load_baseline`):

* a local fp8track run directory (has ``meta.json``; read with
  :class:`fp8track.monitoring.records.RunReader`);
* ``mlflow:<run_id>``, read by :func:`fp8track.trackers.mlflow.read_mlflow_run` (beside the MLflow
  writer) where the tracking URI is the one given (e.g. the trainer's ``MLFlowLogger``), else
  ``MLFLOW_TRACKING_URI``;
* a W&B offline run directory (``.../wandb/offline-run-<ts>-<id>``, its ``run-<id>.wandb`` file, or
  a ``wandb`` directory holding exactly one run), read by
  :func:`fp8track.trackers.wandb.read_wandb_run` (beside the W&B writer). The step is
  ``trainer/global_step`` when logged (Lightning's ``WandbLogger``), else W&B's ``_step``.

The loss metric is the first of :data:`LOSS_KEYS` present unless ``key`` is given. The control's
spikes are found by running :class:`fp8track.analysis.spikes.SpikeDetector` over its loss.
"""

from __future__ import annotations

import bisect
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from fp8track.analysis.spikes import SpikeClassification, SpikeConfig, SpikeEvent, detect_spikes
from fp8track.errors import ConfigError, check_int
from fp8track.monitoring.naming import LOSS_METRIC
from fp8track.trackers.base import StoredRun, rows_from_scalars
from fp8track.trackers.mlflow import read_mlflow_run
from fp8track.trackers.wandb import find_wandb_run, read_wandb_history, read_wandb_run

# fp8track's own loss first (a run directory or a tracker run fp8track wrote), then the bare
# ``loss`` of run directories written before it moved under ``fp8/``, then common user spellings.
LOSS_KEYS = (LOSS_METRIC, "loss", "train_loss", "train/loss", "train_loss_step")
REF_FORMS = (
    "a local fp8track run directory (with meta.json)",
    "'mlflow:<run_id>'",
    "a W&B offline run directory (wandb/offline-run-*) or its run-*.wandb file",
)
CLASSIFICATIONS = ("shared", "fp8_only")


@dataclass(frozen=True)
class Baseline:
    """A control run's loss curve and the spikes found in it.

    Attributes:
        source: the reference it was loaded from (for reports).
        loss: ``{step: loss}``.
        spikes: events of :func:`fp8track.analysis.spikes.detect_spikes` on ``loss`` (final states).
        key: the metric name the loss was read from.
    """

    source: str
    loss: Mapping[int, float]
    spikes: tuple[SpikeEvent, ...] = ()
    key: str = LOSS_METRIC
    meta: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_series(
        cls,
        source: str,
        loss: Mapping[int, float],
        spike_config: SpikeConfig | None = None,
        key: str = LOSS_METRIC,
        meta: Mapping[str, Any] | None = None,
    ) -> Baseline:
        """Build from ``{step: loss}``, detecting the control's spikes."""
        series = {int(s): float(v) for s, v in sorted(loss.items())}
        return cls(source, series, detect_spikes(series, spike_config), key, dict(meta or {}))

    @cached_property
    def steps(self) -> list[int]:
        """Sorted steps of :attr:`loss`."""
        return sorted(self.loss)

    @cached_property
    def step_spacing(self) -> int:
        """Median distance between consecutive logged steps (1 for fewer than two steps)."""
        s = self.steps
        if len(s) < 2:
            return 1
        diffs = sorted(b - a for a, b in zip(s, s[1:], strict=False))
        return max(1, diffs[len(diffs) // 2])

    def loss_at(self, step: int, max_lag: int | None = None) -> float | None:
        """Control loss at the nearest logged step ``<= step`` at most ``max_lag`` steps earlier.

        ``max_lag`` defaults to :attr:`step_spacing` (one logging interval of the control).
        Returns ``None`` when there is no such step.
        """
        lag = self.step_spacing if max_lag is None else max_lag
        i = bisect.bisect_right(self.steps, int(step)) - 1
        if i < 0 or step - self.steps[i] > lag:
            return None
        return self.loss[self.steps[i]]


def loss_gap(
    step: int, loss: float, baseline: Baseline, max_lag: int | None = None
) -> tuple[float, float] | None:
    """Step-aligned ``(loss - control, (loss - control) / |control|)``.

    The control value is :meth:`Baseline.loss_at` (nearest earlier logged step within
    ``max_lag``). ``None`` when there is no control value or either loss is non-finite; the
    relative gap is NaN when the control loss is 0.

    Example:
        >>> b = Baseline("demo", {0: 4.0, 10: 2.0})
        >>> loss_gap(12, 2.5, b), loss_gap(25, 2.5, b)
        ((0.5, 0.25), None)
    """
    ref = baseline.loss_at(step, max_lag)
    loss = float(loss)
    if ref is None or not (math.isfinite(ref) and math.isfinite(loss)):
        return None
    gap = loss - ref
    return gap, (gap / abs(ref) if ref != 0 else math.nan)


def classify_spike(
    event: SpikeEvent, baseline: Baseline, window: int = 50, slower_factor: float = 2.0
) -> SpikeClassification:
    """Shared with the control or FP8-only, with the recovery-time comparison.

    A control event of the same kind whose start is within ``window`` steps of ``event``'s start
    makes it shared (the nearest one is the match).

    Example:
        >>> ctl = SpikeEvent("spike", 100, 101, 5.0, 3.0, 0.1, 20.0, 10, 110, None, "recovered")
        >>> fp8 = SpikeEvent("spike", 120, 121, 6.0, 3.0, 0.1, 30.0, 40, 160, None, "recovered")
        >>> c = classify_spike(fp8, Baseline("ctl", {}, (ctl,)), window=50)
        >>> c.label, c.step_offset, c.recover_ratio, c.slower_recovery
        ('shared', 20, 4.0, True)
        >>> classify_spike(fp8, Baseline("ctl", {}, (ctl,)), window=10).label
        'fp8_only'
    """
    check_int("window", window, 0)
    candidates = [
        c for c in baseline.spikes if c.kind == event.kind and abs(c.start_step - event.start_step) <= window
    ]
    if not candidates:
        return SpikeClassification("fp8_only", window, recover_steps=event.recover_steps)
    match = min(candidates, key=lambda c: (abs(c.start_step - event.start_step), c.start_step))
    ratio = None
    slower = None
    if match.recover_steps is not None:
        if event.recover_steps is None:
            slower = True
        else:
            ratio = event.recover_steps / max(match.recover_steps, 1)
            slower = ratio >= slower_factor
    elif event.recover_steps is not None:
        slower = False
    return SpikeClassification(
        "shared",
        window,
        control_start_step=match.start_step,
        step_offset=event.start_step - match.start_step,
        recover_steps=event.recover_steps,
        control_recover_steps=match.recover_steps,
        recover_ratio=ratio,
        slower_recovery=slower,
    )


def spike_summary(events: Iterable[SpikeEvent], baseline: Baseline, window: int = 50) -> dict[str, Any]:
    """Counts for the troubleshooting path's step 2: FP8 spikes, shared, FP8-only, control spikes,
    and median recovery steps of each side (recovered spikes only; ``None`` if there are none)."""
    spikes = [e for e in events if e.kind == "spike"]
    labels = [classify_spike(e, baseline, window).label for e in spikes]
    ctl = [e for e in baseline.spikes if e.kind == "spike"]

    def med(xs: Sequence[int | None]) -> float | None:
        vals = sorted(x for x in xs if x is not None)
        if not vals:
            return None
        n = len(vals)
        return float(vals[n // 2]) if n % 2 else (vals[n // 2 - 1] + vals[n // 2]) / 2.0

    return {
        "fp8_spikes": len(spikes),
        "shared": labels.count("shared"),
        "fp8_only": labels.count("fp8_only"),
        "control_spikes": len(ctl),
        "fp8_median_recover_steps": med([e.recover_steps for e in spikes]),
        "control_median_recover_steps": med([e.recover_steps for e in ctl]),
        "fp8_not_recovered": sum(1 for e in spikes if e.status == "not_recovered"),
        "control_not_recovered": sum(1 for e in ctl if e.status == "not_recovered"),
    }


# --- loading -----------------------------------------------------------------------------------


def _pick_key(available: Iterable[str], key: str | None, source: str) -> str:
    avail = set(available)
    if key is not None:
        if key not in avail:
            raise ConfigError(
                f"run {source} has no metric {key!r}; it has: {', '.join(sorted(avail)) or 'none'}"
            )
        return key
    for k in LOSS_KEYS:
        if k in avail:
            return k
    raise ConfigError(
        f"run {source} has none of the loss metrics {', '.join(LOSS_KEYS)}; it has: "
        f"{', '.join(sorted(avail)) or 'none'}. Pass key=<metric name>"
    )


@dataclass(frozen=True)
class RunData:
    """Everything the diagnosis reads from one run, whatever stored it.

    Attributes:
        source: the reference it was loaded from.
        metrics: scalar name -> ``{step: value}`` (loss, ``fp8/...`` metrics, ``fp8/eval/<name>``).
        tensor_rows: per (step, layer, tensor, variant) statistics. From a run directory they are
            its ``tensor_stats.jsonl``; from MLflow the ``fp8_tensor_stats.json`` table artifact
            when present; otherwise rebuilt from the per-layer scalars ``fp8/<layer>/<tensor>/<stat>``
            (variant ``"actual"``).
        meta: run metadata (``meta.json``; from MLflow its params/tags, from W&B ``config["fp8track"]``).
        events: ``(kind, step, data)`` of recorded events (run directories only).
        problems: what the reader skipped (run directories only): per file, damaged lines (count,
            line numbers, kinds) or the file missing
            (:func:`fp8track.monitoring.records.summarise_problems`).
    """

    source: str
    metrics: Mapping[str, Mapping[int, float]]
    tensor_rows: Sequence[Any] = ()
    meta: Mapping[str, Any] = field(default_factory=dict)
    events: Sequence[Any] = ()
    problems: Sequence[Mapping[str, Any]] = ()

    def loss_key(self, key: str | None = None) -> str:
        """The loss metric's name: ``key`` if the run has it, else the first of :data:`LOSS_KEYS`."""
        return _pick_key(self.metrics, key, self.source)

    def eval_metrics(self) -> dict[str, dict[int, float]]:
        """``{name: {step: value}}`` of the ``fp8/eval/<name>`` records (validation/downstream)."""
        prefix = EVAL_PREFIX
        return {k[len(prefix) :]: dict(v) for k, v in self.metrics.items() if k.startswith(prefix)}


EVAL_PREFIX = "fp8/eval/"
"""Prefix of the validation/downstream metrics the monitor records per evaluation."""


def _load_run_dir(path: Path) -> RunData:
    from fp8track.monitoring.records import RunReader, summarise_problems

    reader = RunReader(path)
    metrics: dict[str, dict[int, float]] = {}
    for rec in reader.metrics():
        for k, v in rec.metrics.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                metrics.setdefault(k, {})[int(rec.step)] = float(v)
    events = [(e.kind, e.step, e.data) for e in reader.events()]
    rows = list(reader.tensor_stats())
    return RunData(str(path), metrics, rows, reader.meta(), events, summarise_problems(reader.problems))


def _load_mlflow(run_id: str, tracking_uri: str | None) -> RunData:
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise ConfigError(
            f"run 'mlflow:{run_id}' needs a tracking URI: pass tracking_uri / --tracking-uri (the trainer's "
            "MLFlowLogger has one) or set MLFLOW_TRACKING_URI, e.g. sqlite:///mlflow.db"
        )
    return _from_stored(read_mlflow_run(run_id, uri))


def _from_stored(run: StoredRun) -> RunData:
    return RunData(run.source, run.metrics, list(run.tensor_rows), run.meta)


def load_run(ref: str | os.PathLike[str], tracking_uri: str | None = None) -> RunData:
    """Load a run for the diagnosis or as a control: a local fp8track run directory,
    ``"mlflow:<run_id>"`` (``tracking_uri``, else ``MLFLOW_TRACKING_URI``) or a W&B offline run
    directory (or its ``.wandb`` file).

    Raises:
        ConfigError: for a reference in none of the forms (naming them) or a missing run.
    """
    text = os.fspath(ref)
    if not isinstance(text, str) or not text:
        raise ConfigError(f"run reference {ref!r} is empty; give one of: {'; '.join(REF_FORMS)}")
    if text.startswith("mlflow:"):
        run_id = text[len("mlflow:") :].strip()
        if not run_id:
            raise ConfigError(f"run reference {text!r} has no run id; expected 'mlflow:<run_id>'")
        return _load_mlflow(run_id, tracking_uri)
    path = Path(text).expanduser()
    if not path.exists():
        raise ConfigError(f"run reference {text!r} does not exist; give one of: {'; '.join(REF_FORMS)}")
    if (path / "meta.json").is_file():
        return _load_run_dir(path)
    wandb_file = find_wandb_run(path)
    if wandb_file is None:
        raise ConfigError(f"run reference {text!r} is not a run; give one of: {'; '.join(REF_FORMS)}")
    return _from_stored(read_wandb_run(wandb_file))


def load_baseline(
    ref: str | os.PathLike[str],
    tracking_uri: str | None = None,
    *,
    key: str | None = None,
    spike_config: SpikeConfig | None = None,
) -> Baseline:
    """Load a control run's loss curve and detect its spikes.

    Args:
        ref: a local fp8track run directory, ``"mlflow:<run_id>"``, or a W&B offline run directory
            (or its ``.wandb`` file).
        tracking_uri: MLflow tracking URI for ``mlflow:`` refs (else ``MLFLOW_TRACKING_URI``).
        key: the loss metric's name; default: the first of :data:`LOSS_KEYS` the run has.
        spike_config: thresholds for the control's spike detection (default :class:`SpikeConfig`).

    Raises:
        ConfigError: for a reference in none of the forms (naming them), a missing run, or a run
            without a loss metric.
    """
    run = load_run(ref, tracking_uri)
    k = run.loss_key(key)
    series = run.metrics[k]
    if not series:
        raise ConfigError(f"baseline {run.source!r} has no values of {k!r}")
    return Baseline.from_series(run.source, series, spike_config, key=k, meta=run.meta)


__all__ = [
    "Baseline",
    "SpikeClassification",
    "load_baseline",
    "load_run",
    "RunData",
    "rows_from_scalars",
    "EVAL_PREFIX",
    "loss_gap",
    "classify_spike",
    "spike_summary",
    "find_wandb_run",
    "read_wandb_history",
    "LOSS_KEYS",
    "REF_FORMS",
]
