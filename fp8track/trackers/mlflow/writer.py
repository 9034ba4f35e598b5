"""The MLflow tracker (:class:`MLflowTracker`): step batches to one MLflow run.

Per step, one ``log_batch`` (chunks of at most 1000 metrics, MLflow's per-request limit) is made
from a background worker, so the training thread only enqueues. Names are sanitised to the
characters MLflow accepts by :func:`fp8track.monitoring.naming.sanitize_key`. Per-layer rows and
events go to a spool file on local disk as they arrive (:class:`TableSpool`) and are written as
the table artifacts MLflow's ``log_table`` writes, once at the end (or every
``table_every_n_steps``; each write uploads the whole table, so not every step). Memory holds no
table row: ``log_table`` itself appends by downloading the table and rewriting it in pandas,
which would hold the whole table in memory on every write. The recipe goes to params and tags
(``fp8.recipe``...), the most severe event to tags ``fp8.worst_event.*``, and the per-layer
heatmap (:mod:`fp8track.trackers.heatmap`, the report's) to ``fp8_heatmap.png`` via ``log_figure``.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import time
import weakref
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from fp8track.errors import ConfigError, check_int, redacted_output
from fp8track.execution.recipes import scale_warmup_steps
from fp8track.monitoring import naming
from fp8track.monitoring.naming import sanitize_key
from fp8track.monitoring.records import EventRecord, RunMeta, TensorStatsRow, redact
from fp8track.optional import require
from fp8track.trackers.base import (
    EVENT_COLUMNS,
    EVENT_TABLES,
    TENSOR_KEY_COLUMNS,
    StepBatch,
    TablesNotWritten,
    event_row,
    event_severity,
    event_title,
    scalar_metrics,
    tensor_stat_columns,
)
from fp8track.trackers.expert_views import EXPERT_HEATMAP_FILE, ExpertHeatmap, layer_rows
from fp8track.trackers.heatmap import heatmap_figure, summary_for
from fp8track.trackers.mlflow.client import transient_mlflow_error
from fp8track.trackers.mlflow.params import (
    MAX_PARAM_VALUE_LEN,
    MAX_PARAMS_TAGS_PER_BATCH,
    MAX_TAG_VALUE_LEN,
    META_ARTIFACT,
    run_params,
    run_tags,
)
from fp8track.trackers.mlflow.spool import TableSpool
from fp8track.trackers.queued import QueuedTracker
from fp8track.trackers.retry import Backoff

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from mlflow import MlflowClient


MAX_METRICS_PER_BATCH = 1000  # mlflow/utils/validation.py MAX_METRICS_PER_BATCH


HEATMAP_FILE = "fp8_heatmap.png"
TRACKER_BACKOFF = Backoff(for_s=900.0)
"""The tracker's default retry: 0.5 s doubling to 30 s, for up to 15 minutes per step."""


MLFLOW_LOGGED_ARTIFACTS = "mlflow.loggedArtifacts"  # mlflow/utils/mlflow_tags.py: lists a run's tables


class MLflowTracker(QueuedTracker):
    """Logs step batches to one MLflow run.

    Args:
        client: an ``MlflowClient`` (e.g. ``MLFlowLogger.experiment``); built from
            ``tracking_uri`` when None.
        run_id: the run to log into; when None, :meth:`start` creates a run in
            ``experiment_name`` and :meth:`finish` terminates it.
        tracking_uri: used only when ``client`` is None (e.g. ``sqlite:///runs.db``).
        experiment_name, run_name: for a run this tracker creates.
        artifact_location: artifact root of the experiment if this tracker creates it (by
            default MLflow uses ``./mlruns`` under the current directory for a SQLite store).
        table_every_n_steps: write the tables every n logged steps (0 = only at finish).
        max_buffered_rows: tensor rows not yet written at most; reaching it writes the tables
            early (rows wait on local disk, see :class:`TableSpool`, not in memory).
        spool_dir: where rows wait for the next table write (a new temporary directory, removed
            by :meth:`finish`, when None).
        heatmap: log ``fp8_heatmap.png`` (underflow and MSE by layer over steps) at finish
            (:meth:`heatmap_figure`).
        heatmap_stats: the statistics shown in the heatmap.
        heatmap_columns: step columns of the heatmap (a fixed-size summary, see
            :class:`~fp8track.trackers.heatmap.HeatmapSummary`).
        name: tracker name (missed-step file name).
        retry: how one step is retried while the server is unreachable
            (:class:`~fp8track.trackers.retry.Backoff`; default :data:`TRACKER_BACKOFF`: 0.5 s doubling
            to 30 s, for up to 15 minutes; the training thread never waits for it).
        background, max_queue, finish_timeout_s, stall_timeout_s: see
            :class:`~fp8track.trackers.queued.QueuedTracker`.

    Raises:
        ConfigError: bad ``table_every_n_steps``, or a ``file:`` tracking URI (MLflow >= 3.13
            refuses the file store; use ``sqlite:///<path>``).
    """

    coalesces = True  # a flush's loss-only steps go out in the same log_batch as its logging step

    def __init__(
        self,
        client: MlflowClient | None = None,
        run_id: str | None = None,
        *,
        tracking_uri: str | None = None,
        experiment_name: str = "fp8track",
        run_name: str | None = None,
        artifact_location: str | None = None,
        table_every_n_steps: int = 0,
        max_buffered_rows: int = 100_000,
        heatmap: bool = True,
        heatmap_stats: Sequence[str] = ("underflow_pct", "mse"),
        heatmap_columns: int = 256,
        spool_dir: str | Path | None = None,
        name: str = "mlflow",
        background: bool = True,
        max_queue: int = 10_000,
        finish_timeout_s: float = 600.0,
        stall_timeout_s: float = 60.0,
        retry: Backoff = TRACKER_BACKOFF,
    ) -> None:
        super().__init__(
            background=background, max_queue=max_queue, finish_timeout_s=finish_timeout_s,
            stall_timeout_s=stall_timeout_s, retry=retry,
        )
        check_int("max_buffered_rows", max_buffered_rows, 1)
        check_int("table_every_n_steps (0 = at finish only)", table_every_n_steps, 0)
        if client is None and tracking_uri is not None and str(tracking_uri).startswith("file:"):
            raise ConfigError(
                f"tracking_uri {tracking_uri!r} uses MLflow's file store, which MLflow >= 3.13 refuses; "
                "use a database URI such as 'sqlite:///mlflow.db' or an http(s) server URI"
            )
        if client is None:
            client = require("mlflow", "the MLflow tracker").MlflowClient(tracking_uri)
        self.client = client
        self.run_id = run_id
        self.own_run = run_id is None
        self.experiment_name = experiment_name
        self.run_name = run_name
        self.artifact_location = artifact_location
        self.name = name
        self.table_every_n_steps = table_every_n_steps
        self.heatmap = heatmap
        self.heatmap_stats = tuple(heatmap_stats)
        self.max_buffered_rows = max_buffered_rows
        self._keys: dict[str, str] = {}  # raw name -> sanitised key (names repeat every step)
        self._heatmap = summary_for(self.heatmap_stats, heatmap_columns)
        self._experts = ExpertHeatmap()  # MoE: experts x steps (trackers.expert_views)
        self._own_spool_dir = spool_dir is None
        self._spool_dir = Path(
            tempfile.mkdtemp(prefix="fp8track-mlflow-") if spool_dir is None else spool_dir
        )
        if self._own_spool_dir:  # removed by finish, else when the tracker is collected or at exit
            weakref.finalize(self, shutil.rmtree, self._spool_dir, True)
        self._stats_table = TableSpool(self._spool_dir, f"{naming.TABLE_TENSOR_STATS}.json")
        self._event_tables = {
            key: TableSpool(self._spool_dir, f"{key}.json", EVENT_COLUMNS) for key in EVENT_TABLES.values()
        }
        # Tables an existing run may already hold (rows logged before a resume or by a replay),
        # read once before the first write; a run this tracker creates has none.
        self._unseeded = set() if self.own_run else {t.name for t in self._tables()}
        self._ts: tuple[int, int] = (-1, 0)  # (step, ms timestamp): a retried step reuses its timestamp
        self._buffered_step: int | None = None  # last step whose rows/events were buffered
        self._logged_steps: frozenset[int] = frozenset()  # an existing run's steps (set by start)
        self._steps_since_tables = 0
        self.worst_event: EventRecord | None = None
        self._warmup = 0  # the recipe's scale warm-up (steps), set by start from the run metadata

    def _transient(self, exc: BaseException) -> bool:
        return transient_mlflow_error(exc)  # covers the base's connection and time-out errors

    # -- run metadata -----------------------------------------------------------------------
    def _ensure_run(self) -> str:
        if self.run_id is None:
            exp = self.client.get_experiment_by_name(self.experiment_name)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(
                self.experiment_name, artifact_location=self.artifact_location
            )
            self.run_id = self.client.create_run(exp_id, run_name=self.run_name).info.run_id
        return self.run_id

    def start(self, meta: RunMeta) -> None:
        """Write the run's facts: :func:`run_params` as params (short, only those that apply: the
        compare view's axes), :func:`run_tags` as tags (the layer lists), and the whole
        :class:`RunMeta` as the artifact ``fp8track_meta.json`` (read back by :func:`read_mlflow_run`)."""
        from mlflow.entities import Param, RunTag

        run_id = self._ensure_run()
        self._warmup = scale_warmup_steps(meta.recipe)
        if not self.own_run:
            self._logged_steps = self._steps_in_run(run_id)
        p = [Param(sanitize_key(k), redact(v)[:MAX_PARAM_VALUE_LEN]) for k, v in run_params(meta).items()]
        t = [RunTag(sanitize_key(k), redact(v)[:MAX_TAG_VALUE_LEN]) for k, v in run_tags(meta).items()]
        for i in range(0, max(len(p), len(t)), MAX_PARAMS_TAGS_PER_BATCH):
            chunk = slice(i, i + MAX_PARAMS_TAGS_PER_BATCH)
            self.client.log_batch(run_id, params=p[chunk], tags=t[chunk], synchronous=True)
        text = redact(json.dumps(asdict(meta), indent=1, default=str))
        try:  # an unreachable artifact store must not cost the run its metrics
            self.client.log_text(run_id, text, META_ARTIFACT)
        except Exception as exc:
            self._notice(f"{META_ARTIFACT} not written ({type(exc).__name__}: {exc}); the run directory's "
                         "meta.json holds the same")

    def _steps_in_run(self, run_id: str) -> frozenset[int]:
        """Steps of an existing run's ``fp8/loss`` history (the monitor logs it at every optimizer
        step), else ``loss``, else its first ``fp8/`` metric. A run resumed after a crash holds the
        points the process that died had sent; a replay may find points that did arrive. Either way
        those steps' scalars are not sent again."""
        keys = sorted(self.client.get_run(run_id).data.metrics)
        key = next((k for k in (naming.LOSS_METRIC, "loss") if k in keys), None) or next(
            (k for k in keys if k.startswith(f"{naming.PREFIX}/")), None)
        if key is None:
            return frozenset()
        return frozenset(int(m.step) for m in self.client.get_metric_history(run_id, key))

    # -- per step (worker thread) -------------------------------------------------------------
    def _key(self, name: str) -> str:
        key = self._keys.get(name)
        if key is None:
            key = self._keys[name] = sanitize_key(name)
        return key

    def _deliver(self, batch: StepBatch) -> None:
        from mlflow.entities import Metric

        run_id = self._ensure_run()
        step = batch.step
        if self._ts[0] != step:
            self._ts = (step, int(time.time() * 1000))
        # A retry re-sends identical (key, value, timestamp, step) points, which MLflow's stores
        # keep once (its SQL store skips rows that already exist), so a retry adds no duplicate.
        ts = self._ts[1]
        metrics = [
            Metric(self._key(k), v, ts, s)
            for s, m in (*batch.earlier, (step, batch.metrics))
            # a step already in the run (resumed or replayed) is not sent again: one point per step
            if s not in self._logged_steps
            for k, v in scalar_metrics(m).items()
        ]
        for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            self.client.log_batch(run_id, metrics=metrics[i : i + MAX_METRICS_PER_BATCH], synchronous=True)
        if self._buffered_step == step:
            return  # a retry of a step whose rows and events are already buffered
        self._buffered_step = step
        if batch.tensor_rows:
            self._heatmap.add(layer_rows(batch.tensor_rows))  # MoE: one expert's rows in their own view
            self._experts.add(batch.tensor_rows)
            self._spool_tensor_rows(batch.tensor_rows)
        new_worst = None
        for ev in batch.events:
            key = EVENT_TABLES.get(ev.kind)
            if key is not None:
                self._event_tables[key].add([event_row(ev)])
            if event_severity(ev) > -math.inf and (
                self.worst_event is None or self._rank(ev) > self._rank(self.worst_event)
            ):
                self.worst_event = new_worst = ev
        self._steps_since_tables += 1
        try:
            if new_worst is not None:
                self._tag_worst(new_worst)
            due = self.table_every_n_steps and self._steps_since_tables >= self.table_every_n_steps
            if due or self._stats_table.unwritten >= self.max_buffered_rows:
                self._write_tables()
        except Exception as exc:
            # The step's scalars arrived; its rows and events stay buffered and go out with the next
            # table write (a failure of the final one, in finish, is recorded per step). Re-sending
            # the step would duplicate them, so this is a notice, not a failure.
            self._notice(
                f"table write at step {step} failed ({type(exc).__name__}: {str(exc)[:300]}); "
                "rows stay buffered"
            )

    def _in_warmup(self, ev: EventRecord) -> bool:
        """A drift event inside the recipe's scale warm-up (delayed scaling filling its amax
        history, :func:`fp8track.execution.recipes.scale_warmup_steps`): the recipe settling."""
        return ev.kind == "drift" and ev.step < self._warmup

    def _rank(self, ev: EventRecord) -> tuple[bool, float]:
        """Worst first: any event after the warm-up above every warm-up one, then by severity."""
        return (not self._in_warmup(ev), event_severity(ev))

    def _tag_worst(self, ev: EventRecord) -> None:
        d = ev.data
        tags = {
            "fp8.worst_event.kind": ev.kind,
            "fp8.worst_event.step": str(ev.step),
            "fp8.worst_event.severity": repr(event_severity(ev)),
            "fp8.worst_event.title": event_title(ev),
            "fp8.worst_event.layer": str(d.get("layer", "")),
            "fp8.worst_event.in_warmup": str(self._in_warmup(ev)).lower(),
        }
        from mlflow.entities import RunTag

        self.client.log_batch(
            self._ensure_run(),
            tags=[RunTag(k, redact(v)[:MAX_TAG_VALUE_LEN]) for k, v in tags.items()],
            synchronous=True,
        )

    def _spool_tensor_rows(self, rows: Sequence[TensorStatsRow]) -> None:
        table = self._stats_table
        table.add_columns([*TENSOR_KEY_COLUMNS, *tensor_stat_columns(rows)])
        # The table's own columns (a resumed run's table may have brought some): every row has them all.
        cols = table.columns[len(TENSOR_KEY_COLUMNS) :]
        table.add([r.step, r.layer, r.tensor, r.variant, *(r.stats.get(c) for c in cols)] for r in rows)

    def _tables(self) -> list[TableSpool]:
        return [self._stats_table, *self._event_tables.values()]

    def _write_tables(self) -> None:
        """Log every table with rows not yet written, each as the whole table (MLflow keeps one
        file per table); rows of an existing run's tables (a resumed run) come first."""
        run_id = self._ensure_run()
        self._steps_since_tables = 0
        if self._unseeded:
            existing = {a.path for a in self.client.list_artifacts(run_id)}
            for table in self._tables():
                if table.name not in self._unseeded:
                    continue
                if table.name in existing:
                    with tempfile.TemporaryDirectory() as tmp:
                        local = self.client.download_artifacts(run_id, table.name, tmp)
                        table.prepend(json.loads(Path(local).read_text()))
                self._unseeded.discard(table.name)
        for table in self._tables():
            if not table.unwritten:
                continue
            out = self._spool_dir / "upload"
            out.mkdir(exist_ok=True)
            self.client.log_artifact(run_id, str(table.export(out)))
            table.written = table.rows
            self._tag_table(run_id, table.name)

    def _tag_table(self, run_id: str, name: str) -> None:
        """List ``name`` in the run's ``mlflow.loggedArtifacts`` tag as a table, as
        ``log_table`` does (the experiment page offers it for comparison across runs)."""
        tags = self.client.get_run(run_id).data.tags
        listed = json.loads(tags.get(MLFLOW_LOGGED_ARTIFACTS, "[]"))
        entry = {"path": name, "type": "table"}
        if entry not in listed:
            self.client.set_tag(run_id, MLFLOW_LOGGED_ARTIFACTS, json.dumps([*listed, entry]))

    def _close(self) -> None:
        run_id = self._ensure_run()
        try:
            self._write_tables()
        except Exception as exc:
            # The rows are lost with this process unless replayed: name their steps.
            steps = {row[0] for table in self._tables() for row in table.iter_rows(table.written)}
            for step in sorted(steps):
                self._record_failure(step, TablesNotWritten(exc))
            raise
        finally:
            if self._own_spool_dir:
                shutil.rmtree(self._spool_dir, ignore_errors=True)
        if self.heatmap and self._heatmap.labels:
            fig = self.heatmap_figure()
            if fig is not None:
                self.client.log_figure(run_id, fig, HEATMAP_FILE)
        if self.heatmap and (fig := self._experts.figure()) is not None:  # MoE: experts x steps
            self.client.log_figure(run_id, fig, EXPERT_HEATMAP_FILE)
        if self.own_run:
            with redacted_output():  # MLflow prints "View run ... at <tracking URI>", password and all
                self.client.set_terminated(run_id, "FINISHED")

    def heatmap_figure(self) -> Figure | None:
        """The figure ``fp8_heatmap.png`` holds, from the rows delivered so far: the report's heatmap
        (:func:`fp8track.trackers.heatmap.heatmap_figure`) of :attr:`heatmap_stats`."""
        return heatmap_figure(self._heatmap, self.heatmap_stats)
