"""Scale drift: the recipe's scale against the tensor's own current scale, per layer and tensor.

``scale_drift_log2 = log2(scale / current_scale)`` (docs/statistics.md; the one function is
:func:`fp8track.numerics.scaling.drift_log2`, re-exported here): ``> 0`` means the
scale in use is too large for today's amax (overflow risk), ``< 0`` means range is wasted
(underflow risk). One unit is one binade (a factor of 2).

* :class:`DriftTracker` turns per-sample drift values into :class:`DriftEvent` s: an event when
  ``|drift| >= threshold_log2`` for ``consecutive`` samples in a row of one (layer, tensor), in
  one direction. One event per excursion; the (layer, tensor) re-arms when ``|drift|`` falls
  back below the threshold (or flips direction).
* :class:`WhatIfDelayed` answers "what scale would delayed scaling with an amax history of L have
  used here?" for runs on other recipes: fed with each tensor's observed amax on every sampled
  step, it runs a Transformer-Engine-faithful :class:`fp8track.numerics.scaling.DelayedScaler` per
  (layer, tensor) and returns that scale and its drift against the current scale.

Both keep plain-data state (``state_dict`` / ``load_state_dict``) that round-trips through JSON.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

import fp8track.errors as errors
from fp8track.errors import ConfigError, FromDict, check_float, check_int, invalid_choice
from fp8track.monitoring.records import EventRecord
from fp8track.numerics.formats import TENSOR_KINDS, FormatPair, FP8Format, get_format, get_format_pair
from fp8track.numerics.scaling import AMAX_COMPUTE_ALGOS, current_scale, delayed_scaling_update, drift_log2

DIRECTIONS = ("overflow_risk", "underflow_risk")


@dataclass(frozen=True)
class DriftConfig(FromDict):
    """When drift becomes an event.

    Attributes:
        threshold_log2: ``|drift|`` in binades that counts (1.0: the scale is off by 2x or more;
            e4m3 has 17 binades of normal range so one binade is a large but common excursion).
        consecutive: samples in a row (of one layer and tensor, same direction) before the event
            (3: a single stale step after an amax jump is what delayed scaling always does).
    """

    threshold_log2: float = 1.0
    consecutive: int = 3

    def __post_init__(self) -> None:
        check_float("threshold_log2", self.threshold_log2, 0.0, strict=True)
        check_int("consecutive", self.consecutive, 1)


@dataclass(frozen=True)
class DriftEvent:
    """``|scale_drift_log2| >= threshold`` for ``consecutive`` samples of one layer's tensor.

    Attributes:
        step: step at which the event fired (the K-th sample).
        layer, tensor: the layer's qualified name and the tensor kind.
        start_step: first sample of the excursion.
        drift_log2: drift at ``step``; ``peak_drift_log2``: largest ``|drift|`` so far (signed).
        direction: ``"overflow_risk"`` (drift > 0) or ``"underflow_risk"`` (drift < 0).
        consecutive: samples in the excursion when it fired (= the configured K).
        threshold_log2: the threshold used.
        source: ``"recipe"`` (the run's own scales) or ``"what_if"`` (:class:`WhatIfDelayed`).
    """

    step: int
    layer: str
    tensor: str
    start_step: int
    drift_log2: float
    peak_drift_log2: float
    direction: str
    consecutive: int
    threshold_log2: float
    source: str = "recipe"

    @property
    def severity(self) -> float:
        """``|peak drift| / threshold`` (>= 1; 2 means twice as many binades off as the threshold)."""
        return (
            abs(self.peak_drift_log2) / self.threshold_log2 if math.isfinite(self.peak_drift_log2) else 10.0
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_record(self) -> EventRecord:
        data = self.to_dict()
        data["severity"] = self.severity
        return EventRecord(kind="drift", step=self.step, data=data)


class DriftTracker:
    """Per (layer, tensor) excursion counter over ``scale_drift_log2`` samples.

    Example:
        >>> tr = DriftTracker(DriftConfig(threshold_log2=1.0, consecutive=2))
        >>> [e.direction for s, d in enumerate([0.2, 1.5, 1.2, 1.7, 0.1, -2.0, -2.5])
        ...  for e in tr.update(s, "fc1", "weight", d)]
        ['overflow_risk', 'underflow_risk']
    """

    def __init__(self, config: DriftConfig | None = None, source: str = "recipe") -> None:
        self.config = config if config is not None else DriftConfig()
        if not isinstance(self.config, DriftConfig):
            raise ConfigError(f"config must be a DriftConfig, got {type(self.config).__name__}")
        if source not in ("recipe", "what_if"):
            raise invalid_choice("drift source", source, ("recipe", "what_if"))
        self.source = source
        self.events: list[DriftEvent] = []
        # (layer, tensor) -> [sign, count, start_step, peak, fired]
        self._runs: dict[tuple[str, str], list[Any]] = {}

    def update(self, step: int, layer: str, tensor: str, drift: float) -> list[DriftEvent]:
        """Feed one sample; returns the event if this sample completes an excursion of K samples.

        A NaN drift (no usable scale, e.g. an all-zero tensor) is not a sample: it neither counts
        nor breaks a run.
        """
        drift = float(drift)
        if math.isnan(drift):
            return []
        key = (layer, tensor)
        thr = self.config.threshold_log2
        if abs(drift) < thr:
            self._runs.pop(key, None)
            return []
        sign = 1 if drift > 0 else -1
        run = self._runs.get(key)
        if run is None or run[0] != sign:
            run = [sign, 0, int(step), drift, False]
            self._runs[key] = run
        run[1] += 1
        if abs(drift) > abs(run[3]):
            run[3] = drift
        if run[1] >= self.config.consecutive and not run[4]:
            run[4] = True
            event = DriftEvent(
                step=int(step),
                layer=layer,
                tensor=tensor,
                start_step=run[2],
                drift_log2=drift,
                peak_drift_log2=run[3],
                direction="overflow_risk" if sign > 0 else "underflow_risk",
                consecutive=run[1],
                threshold_log2=thr,
                source=self.source,
            )
            self.events.append(event)
            return [event]
        return []

    def update_many(self, step: int, drifts: Mapping[tuple[str, str], float]) -> list[DriftEvent]:
        """:meth:`update` for every ``(layer, tensor) -> drift`` sample of one step."""
        out: list[DriftEvent] = []
        for (layer, tensor), d in drifts.items():
            out += self.update(step, layer, tensor, d)
        return out

    def state_dict(self) -> dict[str, Any]:
        """Plain-data state: each open excursion by name (version 2; version 1 stored them by position)."""
        runs = [
            {"layer": layer, "tensor": tensor, **dict(zip(_RUN_FIELDS, run, strict=True))}
            for (layer, tensor), run in self._runs.items()
        ]
        return errors.save_state(version=2, runs=runs, events=[e.to_dict() for e in self.events])

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (:func:`fp8track.errors.restore_state`: missing keys keep
        their current value, a newer version is a ConfigError)."""

        def run(r: Any) -> tuple[tuple[str, str], list[Any]]:
            if not isinstance(r, Mapping):  # version 1: [layer, tensor, sign, count, start, peak, fired]
                r = dict(zip(("layer", "tensor", *_RUN_FIELDS), r, strict=True))
            values = [
                int(r["sign"]),
                int(r["count"]),
                int(r["start_step"]),
                float(r["peak"]),
                bool(r["fired"]),
            ]
            return (r["layer"], r["tensor"]), values

        errors.restore_state(
            self,
            state,
            {
                "runs": ("_runs", lambda rs: dict(run(r) for r in rs)),
                "events": ("events", lambda es: [DriftEvent(**d) for d in es]),
            },
            version=2,
        )


_RUN_FIELDS = ("sign", "count", "start_step", "peak", "fired")
"""An open excursion of :class:`DriftTracker`, in the order it keeps them."""


@dataclass(frozen=True)
class WhatIf:
    """What delayed scaling would have used at one sampled step for one tensor.

    Attributes:
        scale: the delayed scale (from the history of *earlier* samples; 1.0 before any, as in TE).
        current_scale: ``fmt.max / amax / 2**margin`` of this sample's amax.
        drift_log2: ``log2(scale / current_scale)``; NaN for the first sample (no history yet) or
            an unusable amax.
    """

    scale: float
    current_scale: float
    drift_log2: float


class WhatIfDelayed:
    """Simulates delayed scaling (history ``history_len``, ``algo``, ``margin``) on observed amaxes.

    Feed :meth:`observe` with each (layer, tensor)'s amax at every sampled step, in step order.
    The history counts *samples*: when statistics are sampled every ``n`` steps the simulated
    history spans ``history_len * n`` training steps and, with ``algo="max"``, its amax is a lower
    bound of what real delayed scaling would see (it misses unsampled steps).

    Args:
        formats: a :class:`FormatPair` / its name (``"hybrid"``: e4m3 forward, e5m2 gradients) or
            one :class:`FP8Format` for every tensor.
        history_len, algo, margin: as Transformer Engine's ``DelayedScaling``.

    Example:
        >>> w = WhatIfDelayed("e4m3", history_len=4)
        >>> [round(w.observe(s, "fc1", "activation", a).drift_log2, 3)
        ...  for s, a in enumerate([1.0, 1.0, 4.0])][1:]
        [0.0, 2.0]
    """

    def __init__(
        self,
        formats: str | FormatPair | FP8Format = "hybrid",
        history_len: int = 1024,
        algo: str = "max",
        margin: int = 0,
    ) -> None:
        if isinstance(formats, FP8Format) or (
            isinstance(formats, str) and formats.lower() in ("e4m3", "e5m2")
        ):
            fmt = get_format(formats)
            self.formats = FormatPair(fmt.name, fmt, fmt)
        else:
            self.formats = get_format_pair(formats)
        check_int("history_len", history_len, 1)
        if algo not in AMAX_COMPUTE_ALGOS:
            raise invalid_choice("amax_compute_algo", algo, AMAX_COMPUTE_ALGOS)
        check_int("margin", margin, 0)
        self.history_len, self.algo, self.margin = history_len, algo, margin
        self._batches: dict[str, _FormatBatch] = {}

    def _batch(self, tensor: str) -> _FormatBatch:
        if tensor not in TENSOR_KINDS:
            raise invalid_choice("tensor kind", tensor, TENSOR_KINDS)
        fmt = self.formats.for_tensor(tensor)
        if fmt.name not in self._batches:
            self._batches[fmt.name] = _FormatBatch(fmt, self.history_len, self.algo, self.margin)
        return self._batches[fmt.name]

    def observe(self, step: int, layer: str, tensor: str, amax: float | torch.Tensor) -> WhatIf:
        """One sample: the what-if scale for this step, then the amax enters the history.

        ``step`` is informational (samples must come in step order). NaN/inf/0 amaxes are handled
        as in TE (the scale keeps its previous value).
        """
        return self.observe_many(step, {(layer, tensor): amax})[(layer, tensor)]

    def observe_many(
        self, step: int, amaxes: Mapping[tuple[str, str], float | torch.Tensor]
    ) -> dict[tuple[str, str], WhatIf]:
        """:meth:`observe` for every ``(layer, tensor) -> amax`` of one sampled step, in one batched
        update per format (a few tensor ops per step instead of a dozen per tensor)."""
        groups: dict[str, dict[tuple[str, str], float]] = {}
        for (layer, tensor), a in amaxes.items():
            groups.setdefault(self._batch(tensor).fmt.name, {})[(layer, tensor)] = float(a)
        out: dict[tuple[str, str], WhatIf] = {}
        for name, group in groups.items():
            out.update(self._batches[name].observe(group))
        return {k: out[k] for k in amaxes}

    def state_dict(self) -> dict[str, Any]:
        """Plain data (lists, not tensors): history, scale and sample count per (layer, tensor)."""
        scalers = []
        for batch in self._batches.values():
            for (layer, tensor), i in batch.index.items():
                scalers.append(
                    {
                        "layer": layer,
                        "tensor": tensor,
                        "history": batch.history[:, i].tolist(),
                        "scale": float(batch.scale[i]),
                        "seen": batch.seen[i],
                    }
                )
        return errors.save_state(version=2, scalers=scalers)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (:func:`fp8track.errors.restore_state`: missing keys keep
        their current value, a newer version is a ConfigError)."""
        errors.restore_state(
            self, state, {"scalers": lambda rows: [self._load_scaler(r) for r in rows]}, version=2
        )

    def _load_scaler(self, row: Any) -> None:
        if not isinstance(row, Mapping):  # version 1: [layer, tensor, history, scale, seen]
            row = dict(zip(("layer", "tensor", "history", "scale", "seen"), row, strict=True))
        hist_t = torch.as_tensor(row["history"], dtype=torch.float32)
        if hist_t.numel() != self.history_len:
            raise ConfigError(
                f"checkpointed what-if history has length {hist_t.numel()}, expected {self.history_len}"
            )
        batch = self._batch(row["tensor"])
        i = batch.column((row["layer"], row["tensor"]))
        batch.history[:, i] = hist_t
        batch.scale[i] = float(row["scale"])
        batch.seen[i] = int(row["seen"])


class _FormatBatch:
    """What-if delayed scaling of every (layer, tensor) that uses one FP8 format, as columns of one
    ``[L, n]`` history, updated with :func:`fp8track.numerics.scaling.delayed_scaling_update`."""

    def __init__(self, fmt: FP8Format, history_len: int, algo: str, margin: int) -> None:
        self.fmt, self.history_len, self.algo, self.margin = fmt, history_len, algo, margin
        self.index: dict[tuple[str, str], int] = {}
        self.history = torch.zeros(history_len, 0)
        self.scale = torch.ones(0)
        self.seen: list[int] = []

    def column(self, key: tuple[str, str]) -> int:
        if key not in self.index:
            self.index[key] = len(self.index)
            self.seen.append(0)
            self.history = torch.cat([self.history, torch.zeros(self.history_len, 1)], dim=1)
            self.scale = torch.cat([self.scale, torch.ones(1)])  # TE's initial scale
        return self.index[key]

    def observe(self, amaxes: Mapping[tuple[str, str], float]) -> dict[tuple[str, str], WhatIf]:
        cols = [self.column(k) for k in amaxes]
        a = torch.tensor(list(amaxes.values()), dtype=torch.float32)
        cur = current_scale(a, self.fmt, self.margin, math.nan)
        if cols == list(range(len(self.index))):
            # Every column in column order (each sampled step of a model after its first): the
            # whole history, without a gather and a scatter of every column (the same values).
            used = self.scale
            hist = self.history  # slot 0 updated in place; the update returns a new history
            hist[0] = torch.maximum(hist[0], a)
            self.history, self.scale = delayed_scaling_update(hist, used, self.fmt, self.algo, self.margin)
        else:
            idx = torch.tensor(cols, dtype=torch.long)
            used = self.scale[idx]
            hist = self.history[:, idx]
            hist[0] = torch.maximum(hist[0], a)
            hist, new_scale = delayed_scaling_update(hist, used, self.fmt, self.algo, self.margin)
            self.history[:, idx] = hist
            self.scale[idx] = new_scale
        out = {}
        for i, key, used_j, cur_j in zip(cols, amaxes, used.tolist(), cur.tolist(), strict=True):
            out[key] = WhatIf(used_j, cur_j, drift_log2(used_j, cur_j) if self.seen[i] > 0 else math.nan)
            self.seen[i] += 1
        return out

__all__ = ["DriftConfig", "DriftEvent", "DriftTracker", "WhatIf", "WhatIfDelayed", "drift_log2", "DIRECTIONS"]
