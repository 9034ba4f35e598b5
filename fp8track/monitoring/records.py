"""Record types and the local run directory: the source of truth every tracker is a view of.

A run directory holds append-only JSON Lines files, written before any tracker sees the data:

=====================  ===========================================================================
``meta.json``          :class:`RunMeta`, written once when the run opens
``metrics.jsonl``      one :class:`MetricsRecord` per logging step (scalars, incl. ``loss``)
``tensor_stats.jsonl`` one :class:`TensorStatsRow` per (step, layer, tensor, variant)
``events.jsonl``       :class:`EventRecord` s (spikes, divergence, drift, tracker failures, end)
=====================  ===========================================================================

Values are JSON numbers; ``inf``/``nan`` are written as JSON's non-standard ``Infinity``/``NaN``
(Python's json reads them back). Readers skip a torn last line (a crash mid-write).
"""

from __future__ import annotations

import json
import os
import platform
import socket
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fp8track.errors import ConfigError, check_int
from fp8track.monitoring.naming import LOSS_METRIC

META_FILE = "meta.json"
METRICS_FILE = "metrics.jsonl"
TENSOR_STATS_FILE = "tensor_stats.jsonl"
EVENTS_FILE = "events.jsonl"


@dataclass(frozen=True)
class MetricsRecord:
    """Scalars of one logging step. ``step`` is the trainer's optimizer step; ``time`` is Unix seconds."""

    step: int
    metrics: Mapping[str, float]
    time: float = field(default_factory=time.time)


@dataclass(frozen=True)
class TensorStatsRow:
    """Statistics of one tensor of one layer at one step (long format).

    ``variant`` is ``"actual"`` for the recipe really used, or the name of a what-if recipe
    (e.g. ``"current"``, ``"mxfp8"``) computed on the same tensor.
    """

    step: int
    layer: str
    tensor: str
    stats: Mapping[str, float]
    variant: str = "actual"


@dataclass(frozen=True)
class EventRecord:
    """A discrete event: ``kind`` (e.g. ``"spike"``, ``"drift"``, ``"divergence"``), the step, details."""

    kind: str
    step: int
    data: Mapping[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=time.time)


@dataclass(frozen=True)
class RunMeta:
    """What the run is: identity, recipe, BF16 layers, software versions, host."""

    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    name: str = "fp8track"
    created: float = field(default_factory=time.time)
    recipe: Mapping[str, Any] | None = None
    bf16_layers: Sequence[str] = ()
    fp8_layers: Sequence[str] = ()
    versions: Mapping[str, str] = field(default_factory=lambda: software_versions())
    host: str = field(default_factory=socket.gethostname)
    config: Mapping[str, Any] = field(default_factory=dict)


def software_versions() -> dict[str, str]:
    """Versions of Python, torch and the FP8 libraries that are installed (without importing TE)."""
    from importlib import metadata

    versions = {"python": platform.python_version()}
    for dist in ("torch", "lightning", "torchao", "transformer_engine", "nvdlfw_inspect", "wandb", "mlflow", "fp8track"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return versions


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), default=str)


@dataclass(frozen=True)
class StepBatch:
    """Everything the monitor produced for one logging step.

    Attributes:
        step: the trainer's global step (optimizer steps), >= 0.
        metrics: scalar name -> value; names from :mod:`fp8track.monitoring.naming` (``fp8/loss`` included).
        tensor_rows: per (layer, tensor, variant) statistics of this step (long-format table rows).
        events: spikes, divergence, drift, findings that happened at or were reported at this step.
    """

    step: int
    metrics: Mapping[str, float] = field(default_factory=dict)
    tensor_rows: Sequence[TensorStatsRow] = ()
    events: Sequence[EventRecord] = ()

    def __post_init__(self) -> None:
        check_int("StepBatch.step", self.step, 0)
        if not isinstance(self.metrics, Mapping):
            raise ConfigError(f"StepBatch.metrics must be a mapping name -> float, got {type(self.metrics).__name__}")
        # Sequences become tuples so a batch handed to a worker thread cannot change under it.
        object.__setattr__(self, "tensor_rows", tuple(self.tensor_rows))
        object.__setattr__(self, "events", tuple(self.events))


class RunWriter:
    """Appends records to a run directory; every write is flushed so a crash loses at most a line."""

    def __init__(self, run_dir: str | os.PathLike[str], meta: RunMeta) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.meta = meta
        meta_path = self.run_dir / META_FILE
        if not meta_path.exists():
            meta_path.write_text(json.dumps(asdict(meta), indent=2, default=str))
        self._files = {
            name: open(self.run_dir / name, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
            for name in (METRICS_FILE, TENSOR_STATS_FILE, EVENTS_FILE)
        }

    @classmethod
    def create(cls, log_dir: str | os.PathLike[str], meta: RunMeta) -> RunWriter:
        """A new run directory ``<log_dir>/<meta.run_id>``."""
        return cls(Path(log_dir) / meta.run_id, meta)

    def _append(self, name: str, rows: Sequence[Any]) -> None:
        if not rows:
            return
        f = self._files[name]
        # vars(), not asdict(): records hold plain data, and asdict deep-copies every stats dict.
        f.write("".join(_dumps(vars(r)) + "\n" for r in rows))
        f.flush()

    def write_metrics(self, record: MetricsRecord) -> None:
        self._append(METRICS_FILE, [record])

    def write_tensor_stats(self, rows: Sequence[TensorStatsRow]) -> None:
        self._append(TENSOR_STATS_FILE, rows)

    def write_events(self, events: Sequence[EventRecord]) -> None:
        self._append(EVENTS_FILE, events)

    def close(self) -> None:
        for f in self._files.values():
            f.close()


def _iter_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    if not path.exists():
        return
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                return  # torn last line: the writer died mid-write
            yield json.loads(line)


class RunReader:
    """Reads a run directory written by :class:`RunWriter`."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = Path(run_dir)
        if not (self.run_dir / META_FILE).exists():
            raise FileNotFoundError(f"{self.run_dir} is not an fp8track run directory (no {META_FILE})")

    def meta(self) -> dict[str, Any]:
        return json.loads((self.run_dir / META_FILE).read_text())

    def metrics(self) -> Iterator[MetricsRecord]:
        for d in _iter_jsonl(self.run_dir / METRICS_FILE):
            yield MetricsRecord(**d)

    def tensor_stats(self) -> Iterator[TensorStatsRow]:
        for d in _iter_jsonl(self.run_dir / TENSOR_STATS_FILE):
            yield TensorStatsRow(**d)

    def events(self) -> Iterator[EventRecord]:
        for d in _iter_jsonl(self.run_dir / EVENTS_FILE):
            yield EventRecord(**d)

    def series(self, name: str = LOSS_METRIC) -> dict[int, float]:
        """``{step: value}`` of one scalar (last value wins if a step repeats)."""
        return {r.step: r.metrics[name] for r in self.metrics() if name in r.metrics}
