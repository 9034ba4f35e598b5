"""Weights & Biases adapter.

One ``run.log`` per logging step carrying the trainer step as a metric (``trainer/global_step``,
the same convention as Lightning's ``WandbLogger``; W&B's own ``step=`` must only increase, so
replayed or out-of-order steps would be dropped). ``define_metric`` makes every ``fp8/*`` metric
plot against that step with ``min`` and ``max`` summaries. Per-layer rows go to an
``INCREMENTAL`` ``wandb.Table`` (each log uploads only the new rows); events go to one
incremental table per kind. Once a table is logged its rows are in W&B's files and are dropped
from the ``Table`` object, which wandb would otherwise keep for the whole run (memory then
holds at most ``table_every_n_steps`` steps of rows, whatever the run's length). Events whose
data has ``"alert": True`` raise ``run.alert``, throttled per title. The run config holds the
recipe and the BF16 fallback set.

``wandb`` is imported only when a tracker is built; this module never sets ``WANDB_MODE``.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fp8track.errors import ConfigError, check_int, invalid_choice
from fp8track.monitoring import naming
from fp8track.monitoring.records import EventRecord, RunMeta, TensorStatsRow, redact
from fp8track.optional import require
from fp8track.trackers.base import (
    EVENT_COLUMNS,
    EVENT_TABLES,
    TENSOR_KEY_COLUMNS,
    ScalarsNotWritten,
    StepBatch,
    StoredRun,
    TablesNotWritten,
    event_row,
    rows_from_scalars,
    scalar_metrics,
    tensor_stat_columns,
)
from fp8track.trackers.expert_views import (
    EXPERT_HEATMAP_CAPTION,
    EXPERT_HEATMAP_KEY,
    ExpertHeatmap,
    figure_image,
)
from fp8track.trackers.queued import QueuedTracker

if TYPE_CHECKING:
    import wandb

DEFAULT_STEP_METRIC = "trainer/global_step"
ALERT_LEVELS = ("INFO", "WARN", "ERROR")
_SUMMARY_OPS = ("min", "max", "mean", "last", "first", "none")
MAX_ALERT_TITLE = 63  # W&B: "must be less than 64 characters long"


class WandbTracker(QueuedTracker):
    """Logs step batches to a ``wandb`` run.

    A failure never stops training and never sends a table row twice: rows and events join the
    incremental tables once per step, and when ``run.log`` fails they stay pending and go out with
    a later step, while the step's scalars are recorded as missed (``what="scalars"``) for
    ``fp8track sync``. A run that cannot be opened (``wandb.init`` fails) leaves every step missed
    in full, replayable the same way.

    Args:
        run: a live ``wandb.Run`` (e.g. ``WandbLogger.experiment``), or a zero-argument callable
            that opens one on first use (then a failing ``wandb.init`` is a tracker failure, not
            a training failure). Use :meth:`create` to open one.
        step_metric: the metric carrying the trainer step; ``fp8/*`` plots against it.
        summaries: comma-separated W&B summary ops for ``fp8/*`` (``min``, ``max``, ``mean``,
            ``last``, ``first``, ``none``).
        table_every_n_steps: log the incremental tables on every n-th step that has new rows
            (rows are kept until then; ``finish`` logs any rest). 1 = every such step.
        alert_wait_s: minimum seconds between two alerts with the same title (also passed to
            ``run.alert`` as ``wait_duration``).
        own_run: finish the run in :meth:`finish` (True when :meth:`create` opened it).
        name: tracker name (missed-step file name); change it to run two W&B trackers.
        background, max_queue, finish_timeout_s, stall_timeout_s: see
            :class:`~fp8track.trackers.queued.QueuedTracker`.

    Raises:
        ConfigError: bad ``summaries``, ``table_every_n_steps`` or ``alert_wait_s``.
    """

    monotonic_steps = True  # the step metric of W&B's history must only increase

    def __init__(
        self,
        run: wandb.Run | Callable[[], wandb.Run],
        *,
        step_metric: str = DEFAULT_STEP_METRIC,
        summaries: str = "min,max",
        table_every_n_steps: int = 1,
        alert_wait_s: float = 60.0,
        own_run: bool = False,
        name: str = "wandb",
        background: bool = True,
        max_queue: int = 10_000,
        finish_timeout_s: float = 600.0,
        stall_timeout_s: float = 60.0,
    ) -> None:
        super().__init__(
            background=background, max_queue=max_queue, finish_timeout_s=finish_timeout_s,
            stall_timeout_s=stall_timeout_s,
        )
        for op in summaries.split(","):
            if op.strip().lower() not in _SUMMARY_OPS:
                raise invalid_choice("W&B summary op", op, _SUMMARY_OPS)
        check_int("table_every_n_steps", table_every_n_steps, 1)
        if not alert_wait_s >= 0:
            raise ConfigError(f"alert_wait_s must be >= 0 seconds, got {alert_wait_s!r}")
        if not step_metric:
            raise ConfigError("step_metric must be a non-empty metric name")
        self._open_run = run if callable(run) and not hasattr(run, "log") else None
        self._wandb_run: wandb.Run | None = None if self._open_run is not None else run
        self._meta: RunMeta | None = None
        self._meta_applied = False
        self.name = name
        self.step_metric = step_metric
        self.summaries = summaries
        self.table_every_n_steps = table_every_n_steps
        self.alert_wait_s = float(alert_wait_s)
        self.own_run = own_run
        self._tables: dict[str, Any] = {}  # table name -> wandb.Table (INCREMENTAL)
        self._stat_columns: list[str] | None = None
        self._pending: set[str] = set()  # tables with rows not yet logged
        self._pending_steps: set[int] = set()  # steps whose rows are in those tables
        self._added_step: int | None = None  # last step whose rows/events joined the tables
        self._steps_since_table = 0
        self._last_step = 0
        self._last_alert: dict[str, float] = {}  # title -> time.monotonic() of the last alert sent
        self._experts = ExpertHeatmap()  # MoE: experts x steps, logged at the end (trackers.expert_views)
        self.alerts_sent = 0

    @classmethod
    def create(
        cls,
        *,
        project: str = "fp8track",
        name: str | None = None,
        dir: str | None = None,
        mode: str = "online",
        run_id: str | None = None,
        tracker_name: str = "wandb",
        lazy: bool = False,
        resume: str = "must",
        **kwargs: Any,
    ) -> WandbTracker:
        """Open a run owned by the tracker: ``wandb.init(project, name, dir, mode,
        reinit="create_new")``, with the id ``run_id`` when given (``resume``: ``"must"``, an
        existing run; ``"allow"``, that run if it exists, else a new one with this id). ``mode`` is
        passed to ``wandb.init`` only; the environment is not touched. ``lazy`` opens the run on
        first use instead, so a failing ``wandb.init`` cannot stop training (its steps are
        recorded as missed). ``kwargs`` go to the tracker's constructor."""
        wandb = require("wandb", "the W&B tracker")
        valid_modes = ("online", "offline", "disabled", "shared")
        if mode not in valid_modes:
            raise invalid_choice("W&B mode", mode, valid_modes)
        if resume not in ("must", "allow"):
            raise invalid_choice("W&B resume", resume, ("must", "allow"))
        resume_args = {"id": run_id, "resume": resume} if run_id else {}

        def open_run() -> wandb.Run:
            return wandb.init(
                project=project, name=name, dir=dir, mode=mode, reinit="create_new", **resume_args
            )

        return cls(open_run if lazy else open_run(), own_run=True, name=tracker_name, **kwargs)

    @property
    def opened(self) -> bool:
        """Whether the run is open (a lazily opened run is not until first use)."""
        return self._wandb_run is not None

    @property
    def run(self) -> wandb.Run:
        """The W&B run (opened here on first access when the tracker was given a callable)."""
        if self._wandb_run is None and self._open_run is not None:
            self._wandb_run = self._open_run()
        return self._wandb_run

    def _ensure_run(self) -> wandb.Run:
        run = self.run
        if self._meta is not None and not self._meta_applied:
            self._apply_meta(run, self._meta)
            self._meta_applied = True
        return run

    # -- run metadata -----------------------------------------------------------------------
    def start(self, meta: RunMeta) -> None:
        """Put the recipe, BF16/FP8 layer sets and versions in ``run.config["fp8track"]`` and
        define the step axis and ``fp8/*`` summaries (again on first use if this fails)."""
        self._meta, self._meta_applied = meta, False
        self._ensure_run()

    def _apply_meta(self, run: wandb.Run, meta: RunMeta) -> None:
        m = asdict(meta)
        config = {
            "run_id": m["run_id"],
            "recipe": m["recipe"],
            "bf16_layers": list(m["bf16_layers"]),
            "fp8_layers": list(m["fp8_layers"]),
            "versions": m["versions"],
            "config": m["config"],
        }
        # Through JSON and back so that no credential in any nested value reaches the run's config.
        config = json.loads(redact(json.dumps(config, default=str)))
        run.config.update({"fp8track": config}, allow_val_change=True)
        run.define_metric(self.step_metric)
        run.define_metric(f"{naming.PREFIX}/*", step_metric=self.step_metric, summary=self.summaries)

    # -- per step (worker thread) -------------------------------------------------------------
    def _table(self, key: str, columns: Sequence[str]) -> Any:
        table = self._tables.get(key)
        if table is None:
            wandb = require("wandb", "the W&B tracker")
            table = wandb.Table(columns=list(columns), log_mode="INCREMENTAL", allow_mixed_types=True)
            self._tables[key] = table
        return table

    def _add_tensor_rows(self, rows: Sequence[TensorStatsRow]) -> None:
        if self._stat_columns is None:
            self._stat_columns = tensor_stat_columns(rows)
        table = self._table(naming.TABLE_TENSOR_STATS, [*TENSOR_KEY_COLUMNS, *self._stat_columns])
        for r in rows:
            stats = r.stats
            table.add_data(
                int(r.step), r.layer, r.tensor, r.variant, *(_num(stats.get(c)) for c in self._stat_columns)
            )
        self._pending.add(naming.TABLE_TENSOR_STATS)

    def _add_events(self, events: Sequence[EventRecord]) -> None:
        for ev in events:
            key = EVENT_TABLES.get(ev.kind)
            if key is None:
                continue
            self._table(key, EVENT_COLUMNS).add_data(*event_row(ev))
            self._pending.add(key)

    def _alert(self, events: Sequence[EventRecord]) -> None:
        for ev in events:
            d = ev.data
            if not d.get("alert"):
                continue
            title = str(d.get("title") or f"fp8track {ev.kind} at step {ev.step}")[:MAX_ALERT_TITLE]
            now = time.monotonic()
            last = self._last_alert.get(title)
            if last is not None and now - last < self.alert_wait_s:
                continue
            level = str(d.get("level", "WARN")).upper()
            if level not in ALERT_LEVELS:
                level = "WARN"
            self._ensure_run().alert(
                title=title, text=str(d.get("text", title)), level=level, wait_duration=self.alert_wait_s
            )
            self._last_alert[title] = now
            self.alerts_sent += 1

    def _deliver(self, batch: StepBatch) -> None:
        run = self._ensure_run()  # before touching the tables: a run that cannot open misses the whole step
        if self._added_step != batch.step:  # a retried step must not add its rows twice
            self._added_step = batch.step
            if batch.tensor_rows:
                self._add_tensor_rows(batch.tensor_rows)
                self._experts.add(batch.tensor_rows)
            if batch.events:
                self._add_events(batch.events)
            if batch.tensor_rows or any(ev.kind in EVENT_TABLES for ev in batch.events):
                self._pending_steps.add(batch.step)
            self._steps_since_table += 1
        data: dict[str, Any] = scalar_metrics(batch.metrics)
        data[self.step_metric] = batch.step
        due = bool(self._pending) and self._steps_since_table >= self.table_every_n_steps
        if due:
            data.update({k: self._tables[k] for k in self._pending})
        try:
            run.log(data)
        except Exception as exc:
            # The rows stay pending and go out with a later step: only the scalars are missed.
            raise ScalarsNotWritten(exc) from exc
        if due:
            self._tables_logged()
        self._last_step = batch.step
        if batch.events:
            self._alert(batch.events)

    def _tables_logged(self) -> None:
        """After the ``run.log`` that carried the pending tables: their rows are in W&B's files."""
        for key in self._pending:
            drop_logged_rows(self._tables[key])
        self._pending.clear()
        self._pending_steps.clear()
        self._steps_since_table = 0

    def _close(self) -> None:
        if self._pending:
            data: dict[str, Any] = {k: self._tables[k] for k in self._pending}
            data[self.step_metric] = self._last_step
            try:
                self._ensure_run().log(data)
            except Exception as exc:
                for step in sorted(self._pending_steps):
                    self._record_failure(step, TablesNotWritten(exc))
                raise
            self._tables_logged()
        fig = self._experts.figure()
        if fig is not None:  # MoE: the experts x steps heatmap (trackers.expert_views)
            wandb = require("wandb", "the W&B tracker")
            image = wandb.Image(figure_image(fig), caption=EXPERT_HEATMAP_CAPTION)
            self._ensure_run().log({EXPERT_HEATMAP_KEY: image, self.step_metric: self._last_step})
        if self.own_run:
            self.run.finish()


def drop_logged_rows(table: wandb.Table) -> int:
    """Remove the rows an ``INCREMENTAL`` table has already logged from its ``data``; returns how
    many. Call it right after the ``run.log`` that logged the table.

    wandb keeps every row ever added in ``Table.data`` and logs ``data[_last_logged_idx + 1:]``
    (wandb 0.31: ``wandb/sdk/data_types/table.py`` ``Table._to_table_json``; the index is set to
    ``len(data) - 1`` after each log in ``wandb/sdk/data_types/utils.py`` ``val_to_json``), so an
    incremental table grows by every row of the run. A logged row is already written to the
    increment's file, so dropping it and resetting the index loses nothing. With a wandb whose
    ``Table`` lacks that index (another layout) the rows are kept, as wandb itself does.
    """
    logged = getattr(table, "_last_logged_idx", None)
    if getattr(table, "log_mode", None) != "INCREMENTAL" or not isinstance(logged, int) or logged < 0:
        return 0
    del table.data[: logged + 1]
    table._last_logged_idx = -1
    return logged + 1


def _num(v: Any) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


# --- reading an offline run back (the reader beside its writer) ----------------------------------


def find_wandb_run(path: Path) -> Path | None:
    """The ``run-*.wandb`` file that ``path`` designates (the file, its run directory, or a
    ``wandb`` directory or its parent holding exactly one run); ``None`` if it is not a W&B run.

    Raises:
        ConfigError: when ``path`` holds several W&B runs.
    """
    if path.is_file() and path.suffix == ".wandb":
        return path
    if not path.is_dir():
        return None
    files = sorted(path.glob("run-*.wandb"))
    if len(files) == 1:
        return files[0]
    runs = sorted(p for pat in ("*run-*/run-*.wandb", "wandb/*run-*/run-*.wandb") for p in path.glob(pat))
    if len(runs) > 1:
        raise ConfigError(
            f"{path} holds {len(runs)} W&B runs; pass one run directory: "
            + ", ".join(str(p.parent) for p in runs[:5])
        )
    return runs[0] if runs else None


def _inspect(wandb_file: Path) -> list[dict[str, Any]]:
    """The records of an offline W&B run via ``wandb leet inspect --json`` (W&B 0.31 has no Python
    reader for offline runs)."""
    cmd = [sys.executable, "-m", "wandb", "leet", "inspect", str(wandb_file), "--json"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ConfigError(f"could not read W&B run {wandb_file}: {err}") from err
    if proc.returncode != 0:
        raise ConfigError(
            f"could not read W&B run {wandb_file} with `wandb leet inspect` (needs wandb>=0.31: "
            f"pip install 'fp8track[wandb]'): {proc.stderr.strip()[-500:]}"
        )
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _history(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [rec["history"]["item"] for rec in records if rec.get("type") == "history"]


def read_wandb_history(wandb_file: Path) -> list[dict[str, Any]]:
    """History rows of an offline W&B run (``wandb leet inspect --json``); NaN/inf are the strings
    ``"NaN"``, ``"Infinity"``, ``"-Infinity"`` there (:func:`read_wandb_run` restores them)."""
    return _history(_inspect(wandb_file))


def _history_value(v: Any) -> float | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str) and v in ("NaN", "Infinity", "-Infinity"):
        return float(v)
    return None


def _run_config(wandb_file: Path, records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``config["fp8track"]`` that :meth:`WandbTracker.start` wrote: the run's config updates in
    its records (an offline run has no ``files/config.yaml`` until it is synced), else that file;
    ``{}`` if absent."""
    found: Any = None
    for rec in records:
        body = rec.get("config") if rec.get("type") == "config" else (rec.get("run") or {}).get("config")
        update = body.get("update") if isinstance(body, dict) else None
        if isinstance(update, dict) and "fp8track" in update:
            found = update["fp8track"]
    if found is None:
        import yaml

        try:
            cfg = yaml.safe_load((wandb_file.parent / "files" / "config.yaml").read_text()) or {}
        except (OSError, yaml.YAMLError):
            return {}
        entry = cfg.get("fp8track", {})
        found = entry.get("value", entry) if isinstance(entry, dict) else {}
    return found if isinstance(found, dict) else {}


def read_wandb_run(wandb_file: Path, step_metric: str = DEFAULT_STEP_METRIC) -> StoredRun:
    """Read back an offline run :class:`WandbTracker` (or Lightning's ``WandbLogger``) wrote: every
    numeric history key per step (the step is ``step_metric`` when logged, else W&B's ``_step``),
    rows rebuilt from the per-layer scalars, and ``config["fp8track"]`` as metadata.

    Raises:
        ConfigError: the run cannot be read (see :func:`read_wandb_history`).
    """
    records = _inspect(wandb_file)
    metrics: dict[str, dict[int, float]] = {}
    for r in _history(records):
        step = _history_value(r.get(step_metric, r.get("_step")))
        if step is None or not math.isfinite(step):
            continue
        for k, v in r.items():
            value = _history_value(v)
            if not k.startswith("_") and value is not None and k != step_metric:
                metrics.setdefault(k, {})[int(step)] = value
    rows = _table_rows(wandb_file) or rows_from_scalars(metrics)
    return StoredRun(str(wandb_file.parent), metrics, rows, _run_config(wandb_file, records))


def _table_rows(wandb_file: Path) -> list[TensorStatsRow]:
    """The tensor table as :class:`WandbTracker` logged it (the union of its incremental files under
    ``files/media/table``): every row with its variant, including rows that have no scalars (what-if
    variants, one expert's rows). Empty when the run holds no such table."""
    out: dict[tuple[int, str, str, str], TensorStatsRow] = {}
    folder = wandb_file.parent / "files" / "media" / "table"
    for f in sorted(folder.glob(f"{naming.TABLE_TENSOR_STATS}_*.table.json")):
        try:
            table = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        columns = table.get("columns", [])
        for row in table.get("data", []):
            d = dict(zip(columns, row, strict=False))
            stats = {
                k: float(v)
                for k, v in d.items()
                if k not in TENSOR_KEY_COLUMNS and isinstance(v, (int, float)) and not isinstance(v, bool)
            }
            key = (int(d["step"]), str(d["layer"]), str(d["tensor"]), str(d.get("variant", "actual")))
            out[key] = TensorStatsRow(key[0], key[1], key[2], stats, key[3])
    return list(out.values())
