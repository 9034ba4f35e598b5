"""The tracker interface (:class:`Tracker`) and what every tracker shares: the run read back
(:class:`StoredRun`), the table layouts (event and tensor-statistics columns, event titles), and
the two partial-failure exceptions a tracker reports a step with.

A tracker is a *view* of the local run directory (docs/ARCHITECTURE.md): the monitor writes every
record there first, then hands one :class:`StepBatch` per logging step to a
:class:`~fp8track.trackers.fanout.TrackerFanout`, which never lets a tracker stop training
(:mod:`fp8track.trackers.fanout`: warned once, missed steps kept for ``fp8track sync``).
:class:`~fp8track.trackers.queued.QueuedTracker` delivers from a background worker with retries.
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fp8track.monitoring import naming
from fp8track.monitoring.records import EventRecord, RunMeta, StepBatch, TensorStatsRow, redact

EVENT_TABLES: Mapping[str, str] = {
    "spike": naming.TABLE_SPIKE_EVENTS,
    "nonfinite": naming.TABLE_SPIKE_EVENTS,
    "divergence": naming.TABLE_SPIKE_EVENTS,
    "drift": naming.TABLE_DRIFT_EVENTS,
    "finding": naming.TABLE_FINDINGS,
}
"""Event kind -> tracker table. Other kinds (tracker failures, end markers) stay local only."""

EVENT_COLUMNS: tuple[str, ...] = ("step", "kind", "layer", "tensor", "severity", "title", "data")
"""Columns of every event table; ``data`` is the event's full payload as JSON text."""

TENSOR_KEY_COLUMNS: tuple[str, ...] = ("step", "layer", "tensor", "variant")
"""Leading columns of the long-format tensor statistics table; one column per statistic follows."""


@dataclass(frozen=True)
class StoredRun:
    """What a tracker's reader found of one run (plain data; the analysis builds its ``RunData``
    from it).

    Attributes:
        source: the reference it was read from (``mlflow:<id>``, a W&B run directory).
        metrics: scalar name -> ``{step: value}``.
        tensor_rows: per (step, layer, tensor, variant) statistics: the tracker's tensor table when
            it has one, else rebuilt from the per-layer scalars (:func:`rows_from_scalars`).
        meta: run metadata in the shape of ``meta.json`` (``run_id``, ``name``, ``recipe``,
            ``config``...).
    """

    source: str
    metrics: Mapping[str, Mapping[int, float]]
    tensor_rows: Sequence[TensorStatsRow] = ()
    meta: Mapping[str, Any] = field(default_factory=dict)


def rows_from_scalars(metrics: Mapping[str, Mapping[int, float]]) -> list[TensorStatsRow]:
    """Rebuild tensor-statistics rows from per-layer scalars ``fp8/<layer>/<tensor>/<stat>`` (what a
    tracker keeps when its tables are unavailable); variant ``"actual"``.

    Example:
        >>> rows_from_scalars({"fp8/fc1/activation/mse": {3: 0.5}, "fp8/fc1/activation/amax": {3: 2.0},
        ...                    "fp8/loss": {3: 1.0}})  # doctest: +NORMALIZE_WHITESPACE
        [TensorStatsRow(step=3, layer='fc1', tensor='activation', stats={'mse': 0.5, 'amax': 2.0},
                        variant='actual')]
    """
    from fp8track.numerics.formats import TENSOR_KINDS
    from fp8track.numerics.stats import STAT_NAMES

    cells: dict[tuple[int, str, str], dict[str, float]] = {}
    for name, series in metrics.items():
        parts = name.split("/")
        if (
            len(parts) < 4
            or parts[0] != naming.PREFIX
            or parts[-2] not in TENSOR_KINDS
            or parts[-1] not in STAT_NAMES
        ):
            continue
        layer = "/".join(parts[1:-2])
        for step, v in series.items():
            cells.setdefault((int(step), layer, parts[-2]), {})[parts[-1]] = float(v)
    return [TensorStatsRow(s, layer, t, stats) for (s, layer, t), stats in sorted(cells.items())]


class ScalarsNotWritten(Exception):
    """A step's table rows and events were kept by the tracker (they go out with a later step) but
    its scalars did not arrive. Recorded as ``what="scalars"``; replay then re-sends only the
    scalars of that step, so table rows are never sent twice."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.__cause__ = cause


class TablesNotWritten(Exception):
    """A step's scalars reached the tracker but its table rows/events did not (e.g. the final
    table write failed). Recorded as ``what="tables"``; replay then re-sends only the rows and
    events of that step, so scalar histories get no duplicate points."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.__cause__ = cause


def scalar_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The entries of ``metrics`` that are real numbers, as floats (bools, strings, None dropped)."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if isinstance(v, bool) or v is None:
            continue
        try:
            out[k] = float(v)
        except (TypeError, ValueError):
            continue
    return out


def event_row(event: EventRecord) -> list[Any]:
    """One row of an event table (columns :data:`EVENT_COLUMNS`)."""
    d = event.data
    severity = d.get("severity")
    return [
        int(event.step),
        event.kind,
        str(d.get("layer", "")),
        str(d.get("tensor", "")),
        float(severity) if isinstance(severity, (int, float)) and not isinstance(severity, bool) else None,
        redact(event_title(event)),
        redact(json.dumps(dict(d), default=str, sort_keys=True)),
    ]


def event_title(event: EventRecord) -> str:
    """The event's ``data["title"]``, else one built from its kind, layer, tensor, what it is
    (direction, status or reason) and step: ``"drift in fc1.activation (overflow_risk) at step 210"``."""
    d = event.data
    if d.get("title"):
        return str(d["title"])
    where = ".".join(str(d[k]) for k in ("layer", "tensor") if d.get(k))
    what = next((str(d[k]) for k in ("direction", "status", "reason") if d.get(k)), "")
    words = [event.kind.replace("_", " ")]
    if where:
        words.append(f"in {where}")
    if what:
        words.append(f"({what})")
    return " ".join([*words, f"at step {event.step}"])


def event_severity(event: EventRecord) -> float:
    """``data["severity"]`` as a float (higher is worse); ``-inf`` when absent or not a finite number."""
    s = event.data.get("severity")
    if isinstance(s, bool) or not isinstance(s, (int, float)) or math.isnan(s):
        return -math.inf
    return float(s)


def tensor_stat_columns(rows: Sequence[TensorStatsRow]) -> list[str]:
    """Statistic columns for a table started with ``rows``: fp8track's statistics first, in their
    fixed order, then any other names (e.g. from Transformer Engine) in order of appearance."""
    from fp8track.numerics.stats import STAT_NAMES

    seen: dict[str, None] = {}
    for r in rows:
        for k in r.stats:
            seen.setdefault(k, None)
    known = [s for s in STAT_NAMES if s in seen]
    return known + [k for k in seen if k not in STAT_NAMES]


class Tracker(ABC):
    """A destination for step batches (W&B, MLflow, ...).

    Subclasses implement :meth:`log`; :meth:`start` and :meth:`finish` are optional. ``log`` must
    not block the training thread for long (see :class:`~fp8track.trackers.queued.QueuedTracker`).
    Errors may be raised directly, or reported later through :meth:`take_failures`;
    :class:`~fp8track.trackers.fanout.TrackerFanout` handles both.
    """

    name: str = "tracker"
    # True where a step sent twice would break the step axis (W&B's history, a Lightning logger): a
    # resumed run then skips the steps the process that died had recorded (see TrackerFanout.start).
    monotonic_steps: bool = False
    coalesces: bool = False
    """Whether :meth:`log` takes a batch's ``earlier`` steps (one call per flush); others get one
    batch per step (:meth:`StepBatch.split`)."""

    def start(self, meta: RunMeta) -> None:  # noqa: B027 (optional hook)
        """Record what the run is (recipe, BF16 layers, versions) as config/params/tags."""

    @abstractmethod
    def log(self, batch: StepBatch) -> None:
        """Deliver (or enqueue) one logging step."""

    def finish(self) -> None:  # noqa: B027 (optional hook)
        """Flush everything, write tables and figures, close what this tracker opened."""

    def take_failures(self) -> list[tuple[int | None, BaseException]]:
        """Failures found since the last call, as ``(step or None, exception)``; clears them."""
        return []

    def take_notices(self) -> list[str]:
        """Conditions worth one warning that lose nothing (e.g. "retrying"); clears them."""
        return []
