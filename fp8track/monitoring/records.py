"""Record types and the local run directory: the source of truth every tracker is a view of.

A run directory holds append-only JSON Lines files, written before any tracker sees the data:

=====================  ===========================================================================
``meta.json``          :class:`RunMeta`, written once when the run opens
``metrics.jsonl``      one :class:`MetricsRecord` per logging step (scalars, incl. ``loss``)
``tensor_stats.jsonl`` one :class:`TensorStatsRow` per (step, layer, tensor, variant)
``events.jsonl``       :class:`EventRecord` s (spikes, divergence, drift, tracker failures, end)
=====================  ===========================================================================

Values are JSON numbers; ``inf``/``nan`` are written as JSON's non-standard ``Infinity``/``NaN``
(Python's json reads them back). The reader never stops on damage: a torn last line (a crash
mid-write) or a corrupted line (bad JSON, wrong fields) is skipped, counted in
:attr:`RunReader.problems` and reported once with a ``RuntimeWarning``.
"""

from __future__ import annotations

import json
import math
import os
import platform
import socket
import time
import uuid
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

from fp8track.errors import ConfigError, check_int, redact
from fp8track.monitoring import writer_lock
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
    for dist in (
        "torch",
        "lightning",
        "torchao",
        "transformer_engine",
        "nvdlfw_inspect",
        "wandb",
        "mlflow",
        "fp8track",
    ):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return versions


def _dumps(obj: Any) -> str:
    """One JSON line holding what ``json.dumps(obj, separators=(",", ":"), default=str)`` holds.

    orjson writes plain data (exact ``str``/``int``/``float``/``bool``/``list``/``tuple``/``dict``)
    about 6x faster than ``json``, whose float formatting (~0.4 us a value, 13 per statistics row)
    was the largest part of a sampled step's flush. orjson would write ``NaN``/``Infinity`` as
    ``null``: a line that comes out holding ``null`` is written again with each non-finite float
    spelled as ``json`` spells it (:func:`_non_finite_as_json`), so one infinite SQNR does not send
    a whole metrics record back to ``json``. Data orjson does not take as plain (a subclass, a
    non-string key, an int over 64 bits, a dataclass or a path that ``default=str`` turns into a
    string) is written by ``json``. Every line parses to the same values either way.
    """
    try:
        line = orjson.dumps(obj, option=_ORJSON_PLAIN_DATA_ONLY)
    except TypeError:  # orjson.JSONEncodeError: a type it does not write as json does
        return _ENCODER.encode(obj)
    if b"null" in line:  # a None, a non-finite float, or "null" inside a string
        line = orjson.dumps(_non_finite_as_json(obj), option=_ORJSON_PLAIN_DATA_ONLY)
    return line.decode()


def _non_finite_as_json(obj: Any) -> Any:
    """``obj`` (plain data: orjson took it) with each NaN/inf float replaced by ``json``'s spelling
    as an ``orjson.Fragment`` (written verbatim)."""
    kind = type(obj)
    if kind is float:
        if obj != obj:
            return _NAN
        return _POS_INF if obj == math.inf else _NEG_INF if obj == -math.inf else obj
    if kind is dict:
        return {k: _non_finite_as_json(v) for k, v in obj.items()}
    if kind is list or kind is tuple:
        return [_non_finite_as_json(v) for v in obj]
    return obj


_NAN, _POS_INF, _NEG_INF = (orjson.Fragment(t) for t in (b"NaN", b"Infinity", b"-Infinity"))

# What json.dumps(obj, separators=(",", ":"), default=str) builds on every call, built once.
_ENCODER = json.JSONEncoder(separators=(",", ":"), default=str)
# Types orjson would write its own way (dataclasses as objects, datetimes in ISO form, a float or
# str subclass) go to its ``default``, which is unset: it raises and json writes the line.
_ORJSON_PLAIN_DATA_ONLY = (
    orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_SUBCLASS
)


@dataclass(frozen=True)
class StepBatch:
    """Everything the monitor produced for one logging step.

    Attributes:
        step: the trainer's global step (optimizer steps), >= 0.
        metrics: scalar name -> value; names from :mod:`fp8track.monitoring.naming` (``fp8/loss`` included).
        tensor_rows: per (layer, tensor, variant) statistics of this step (long-format table rows).
        events: spikes, divergence, drift, findings that happened at or were reported at this step.
        earlier: ``(step, metrics)`` of earlier steps flushed with this one (the losses of the
            unsampled steps since the last logging step), in step order: one tracker call for the
            whole flush (trackers that cannot take them get :meth:`split` batches).
    """

    step: int
    metrics: Mapping[str, float] = field(default_factory=dict)
    tensor_rows: Sequence[TensorStatsRow] = ()
    events: Sequence[EventRecord] = ()
    earlier: Sequence[tuple[int, Mapping[str, float]]] = ()

    @property
    def steps(self) -> list[int]:
        """Every step this batch carries, in order (the earlier ones, then :attr:`step`)."""
        return [s for s, _ in self.earlier] + [self.step]

    def split(self) -> list[StepBatch]:
        """One batch per step: each earlier step's metrics alone, then this step without them."""
        if not self.earlier:
            return [self]
        return [StepBatch(s, m) for s, m in self.earlier] + [
            StepBatch(self.step, self.metrics, self.tensor_rows, self.events)
        ]

    def __post_init__(self) -> None:
        check_int("StepBatch.step", self.step, 0)
        if not isinstance(self.metrics, Mapping):
            raise ConfigError(
                f"StepBatch.metrics must be a mapping name -> float, got {type(self.metrics).__name__}"
            )
        # Sequences become tuples so a batch handed to a worker thread cannot change under it.
        object.__setattr__(self, "tensor_rows", tuple(self.tensor_rows))
        object.__setattr__(self, "events", tuple(self.events))
        earlier = tuple((int(s), m) for s, m in self.earlier)
        if any(s >= self.step for s, _ in earlier):
            raise ConfigError(f"StepBatch.earlier holds a step >= {self.step}: {[s for s, _ in earlier]}")
        object.__setattr__(self, "earlier", earlier)


class RunWriter:
    """Appends records to a run directory; every write is flushed so a crash loses at most a line.

    A directory that cannot be created or written is a :class:`ConfigError` here, before step 0,
    and so is a directory another live process is writing (:mod:`fp8track.monitoring.writer_lock`).
    A write that fails later (a full disk, a vanished mount) never raises: it warns once
    (``RuntimeWarning``), counts the lost lines in :attr:`lines_lost` and retries on the next write.

    Args:
        run_dir: the run directory (created if missing).
        meta: written to ``meta.json`` when the directory is new.
        resume_step: a run resumed from a checkpoint taken before optimizer step ``resume_step``:
            lines of steps >= ``resume_step`` (written after that checkpoint by the process that
            died) are removed, so each step is recorded once, by the resumed timeline.
    """

    def __init__(
        self, run_dir: str | os.PathLike[str], meta: RunMeta, resume_step: int | None = None
    ) -> None:
        self.run_dir = Path(run_dir)
        self.meta = meta
        self.lines_lost = 0
        self.lines_dropped_on_resume = 0
        # The last step the process that died had recorded (None: not resumed, or nothing after
        # the checkpoint). Trackers are fed after the local record, so none of them can have a later step.
        self.recorded_before_resume: int | None = None
        self._warned = False
        meta_path = self.run_dir / META_FILE
        self._lock = None
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            # before anything is truncated or appended: a live second writer is refused here
            self._lock = writer_lock.acquire(self.run_dir)
            if not meta_path.exists():
                meta_path.write_text(redact(json.dumps(asdict(meta), indent=2, default=str)))
            if resume_step is not None:
                names = (METRICS_FILE, TENSOR_STATS_FILE, EVENTS_FILE)
                truncated = [_truncate_from_step(self.run_dir / n, resume_step) for n in names]
                self.lines_dropped_on_resume = sum(dropped for dropped, _ in truncated)
                self.recorded_before_resume = max(
                    (last for _, last in truncated if last is not None), default=None
                )
            self._files = {
                name: open(self.run_dir / name, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
                for name in (METRICS_FILE, TENSOR_STATS_FILE, EVENTS_FILE)
            }
        except OSError as exc:
            raise ConfigError(
                f"log_dir: cannot write the run directory {str(self.run_dir)!r} ({exc.strerror or exc}); "
                "pass a writable log_dir"
            ) from exc

    @classmethod
    def create(
        cls, log_dir: str | os.PathLike[str], meta: RunMeta, resume_step: int | None = None
    ) -> RunWriter:
        """A new (or, with ``resume_step``, resumed) run directory ``<log_dir>/<meta.run_id>``."""
        return cls(Path(log_dir) / meta.run_id, meta, resume_step)

    def _append(self, name: str, rows: Sequence[Any]) -> None:
        if not rows:
            return
        f = self._files[name]
        # vars(), not asdict(): records hold plain data, and asdict deep-copies every stats dict.
        text = redact("".join(_dumps(vars(r)) + "\n" for r in rows))
        try:
            f.write(text)
            f.flush()
        except (OSError, ValueError) as exc:  # ValueError: the handle could not be reopened last time
            self.lines_lost += len(rows)
            if not self._warned:
                self._warned = True
                why = getattr(exc, "strerror", None) or exc  # a ValueError has no strerror
                warnings.warn(
                    f"fp8track: cannot write {self.run_dir / name} ({why}); "
                    "training continues, records of the steps that fail are lost "
                    "(counted in RunWriter.lines_lost) and trackers "
                    "still receive them. Further write errors are not reported",
                    RuntimeWarning,
                    stacklevel=4,
                )
            self._reopen(name)

    def _reopen(self, name: str) -> None:
        """Drop what a failed write left in the file's buffer: close the handle (its flush fails
        again, the descriptor is closed anyway) and open a fresh one for the next write."""
        try:
            self._files[name].close()
        except OSError:
            pass
        try:
            self._files[name] = open(self.run_dir / name, "a", encoding="utf-8")  # noqa: SIM115
        except OSError:
            pass  # stays closed: the next write raises ValueError, counted as lost, and tries again

    def write_metrics(self, record: MetricsRecord) -> None:
        self._append(METRICS_FILE, [record])

    def write_tensor_stats(self, rows: Sequence[TensorStatsRow]) -> None:
        self._append(TENSOR_STATS_FILE, rows)

    def write_events(self, events: Sequence[EventRecord]) -> None:
        self._append(EVENTS_FILE, events)

    def close(self) -> None:
        for f in self._files.values():
            try:
                f.close()
            except OSError:
                pass  # already reported by the failed write
        writer_lock.release(self._lock)


def _truncate_from_step(path: Path, step: int) -> tuple[int, int | None]:
    """Remove the lines of ``path`` whose ``step`` is >= ``step`` (and a torn last line); atomic.
    Returns the number of lines removed and the largest step among them (None: none had one)."""
    if not path.exists():
        return 0, None
    keep: list[bytes] = []
    dropped, last = 0, None
    with open(path, "rb") as f:
        for raw in f:
            try:
                s = json.loads(raw).get("step") if raw.endswith(b"\n") else None
            except (ValueError, AttributeError):
                s = None
            if isinstance(s, int) and s < step:
                keep.append(raw)
            else:
                dropped += 1
                if isinstance(s, int):
                    last = s if last is None else max(last, s)
    if dropped:
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_bytes(b"".join(keep))
        os.replace(tmp, path)
    return dropped, last


def _check_record(record: Any) -> None:
    """Field types a reader relies on (a hand-edited or corrupted line can have any JSON)."""
    if not isinstance(record.step, int) or isinstance(record.step, bool):
        raise TypeError(f"step {record.step!r} is not an integer")
    for name in ("metrics", "stats", "data"):
        value = getattr(record, name, {})
        if not isinstance(value, Mapping):
            raise TypeError(f"{name} is a {type(value).__name__}, not an object")


@dataclass(frozen=True)
class ReadProblem:
    """A line of a run-directory file the reader skipped: ``kind`` is ``"torn_last_line"`` (the
    writer died mid-line) or ``"corrupt_line"``; ``line`` is 1-based. A record file that is not
    there at all is kind ``"missing_file"`` with line 0."""

    file: str
    line: int
    kind: str
    detail: str


MAX_LISTED_LINES = 200
"""Damaged line numbers listed per file in :func:`summarise_problems` (the count covers them all)."""


def summarise_problems(problems: Sequence[ReadProblem]) -> list[dict[str, Any]]:
    """Per file, what the reader skipped, as plain data (diagnosis.json, the report): ``file``,
    ``missing`` (the file is not there), ``damaged_lines`` (how many), ``lines`` (their numbers,
    the first :data:`MAX_LISTED_LINES`), ``kinds`` (count per kind) and the first ``detail``."""
    out: dict[str, dict[str, Any]] = {}
    for p in problems:
        entry = out.setdefault(
            p.file,
            {"file": p.file, "missing": False, "damaged_lines": 0, "lines": [], "kinds": {}, "detail": ""},
        )
        if p.kind == "missing_file":
            entry["missing"] = True
            entry["detail"] = p.detail
            continue
        entry["damaged_lines"] += 1
        if len(entry["lines"]) < MAX_LISTED_LINES:
            entry["lines"].append(p.line)
        entry["kinds"][p.kind] = entry["kinds"].get(p.kind, 0) + 1
        entry["detail"] = entry["detail"] or p.detail
    return list(out.values())


class RunReader:
    """Reads a run directory written by :class:`RunWriter`, skipping and reporting damaged lines.

    Raises:
        ConfigError: ``run_dir`` does not exist, is not a run directory (no ``meta.json``), or its
            ``meta.json`` is not a JSON object.
    """

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = Path(run_dir)
        if not self.run_dir.is_dir():
            raise ConfigError(
                f"run directory {str(self.run_dir)!r} does not exist (expected a folder holding {META_FILE})"
            )
        if not (self.run_dir / META_FILE).exists():
            raise ConfigError(
                f"{str(self.run_dir)!r} is not an fp8track run directory: it has no {META_FILE} "
                f"(a run directory holds {META_FILE}, {METRICS_FILE}, {TENSOR_STATS_FILE}, {EVENTS_FILE})"
            )
        self.problems: list[ReadProblem] = []
        self._reported: set[tuple[str, int]] = set()
        self.meta()  # a corrupted meta.json is refused here, not halfway through a replay

    def meta(self) -> dict[str, Any]:
        path = self.run_dir / META_FILE
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(
                f"{str(path)!r} is corrupted (not JSON: {exc}); the run directory cannot be read"
            ) from exc
        if not isinstance(d, dict):
            raise ConfigError(f"{str(path)!r} is corrupted: expected a JSON object, got {type(d).__name__}")
        return d

    def _problem(self, name: str, line: int, kind: str, detail: str) -> None:
        if (name, line) in self._reported:
            return  # the same file read twice: report each damaged line once
        self._reported.add((name, line))
        self.problems.append(ReadProblem(name, line, kind, detail))
        if len(self._reported) == 1:
            where = f"{self.run_dir / name}" + (f" line {line}" if line else "")
            warnings.warn(
                f"fp8track: {where}: {kind} ({detail}); skipped. Every damaged line and missing file "
                "is listed in RunReader.problems (and in a diagnosis' data_problems)",
                RuntimeWarning,
                stacklevel=4,
            )

    def _records(self, name: str, build: Any) -> Iterator[Any]:
        path = self.run_dir / name
        if not path.exists():  # a writer creates all three record files: this one was lost
            self._problem(name, 0, "missing_file", f"the run directory has no {name}")
            return
        with open(path, "rb") as f:
            for i, raw in enumerate(f, start=1):
                if not raw.endswith(b"\n"):
                    self._problem(name, i, "torn_last_line", f"{len(raw)} bytes without a newline")
                    return
                if not raw.strip():
                    continue
                try:
                    d = json.loads(raw)
                    if not isinstance(d, dict):
                        raise TypeError(f"a JSON {type(d).__name__}, not an object")
                    record = build(**d)
                    _check_record(record)
                except (
                    ValueError,
                    TypeError,
                ) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                    self._problem(name, i, "corrupt_line", f"{type(exc).__name__}: {str(exc)[:200]}")
                    continue
                yield record

    def metrics(self) -> Iterator[MetricsRecord]:
        return self._records(METRICS_FILE, MetricsRecord)

    def tensor_stats(self) -> Iterator[TensorStatsRow]:
        return self._records(TENSOR_STATS_FILE, TensorStatsRow)

    def events(self) -> Iterator[EventRecord]:
        return self._records(EVENTS_FILE, EventRecord)

    def series(self, name: str = LOSS_METRIC) -> dict[int, float]:
        """``{step: value}`` of one scalar (last value wins if a step repeats)."""
        out: dict[int, float] = {}
        for r in self.metrics():
            if isinstance(r.metrics, Mapping) and name in r.metrics:
                out[r.step] = r.metrics[name]
        return out
