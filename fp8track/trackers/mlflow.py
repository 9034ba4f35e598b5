"""MLflow adapter.

Per step, one ``log_batch`` (chunks of at most 1000 metrics, MLflow's per-request limit) is made
from a background worker, so the training thread only enqueues. Names are sanitised to the
characters MLflow accepts by :func:`fp8track.monitoring.naming.sanitize_key`. Per-layer rows and
events are buffered and written with ``log_table`` once at the end (or every
``table_every_n_steps``: ``log_table`` appends by downloading and rewriting the file, so it must
not run every step). The recipe goes to params and tags
(``fp8.recipe``...), the most severe event to tags ``fp8.worst_event.*``, and a per-layer heatmap
of underflow and MSE over steps to ``fp8_heatmap.png`` via ``log_figure``.

``mlflow`` is imported only when a tracker is built.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from fp8track.errors import ConfigError, check_int
from fp8track.monitoring import naming
from fp8track.monitoring.naming import sanitize_key
from fp8track.monitoring.records import EventRecord, RunMeta, TensorStatsRow
from fp8track.optional import require
from fp8track.trackers.base import (
    EVENT_COLUMNS,
    EVENT_TABLES,
    TENSOR_KEY_COLUMNS,
    QueuedTracker,
    StepBatch,
    TablesNotWritten,
    event_row,
    event_severity,
    scalar_metrics,
    tensor_stat_columns,
)

if TYPE_CHECKING:
    import numpy as np
    from matplotlib.figure import Figure
    from mlflow import MlflowClient

MAX_METRICS_PER_BATCH = 1000  # mlflow/utils/validation.py MAX_METRICS_PER_BATCH
MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_PARAM_VALUE_LEN = 6000
MAX_TAG_VALUE_LEN = 8000
HEATMAP_FILE = "fp8_heatmap.png"


def flatten(prefix: str, value: Any) -> dict[str, str]:
    """Nested mappings -> ``{"prefix.a.b": "value"}`` with string values (for params/tags)."""
    out: dict[str, str] = {}
    if isinstance(value, Mapping):
        for k, v in value.items():
            out.update(flatten(f"{prefix}.{k}", v))
    elif isinstance(value, (list, tuple)):
        out[prefix] = ",".join(map(str, value))
    else:
        out[prefix] = str(value)
    return out


def heatmap_matrix(
    rows: Iterable[TensorStatsRow], stat: str, variants: Sequence[str] = ("actual", "shadow")
) -> tuple[list[str], list[int], np.ndarray]:
    """Layer-by-step matrix of one statistic, over the rows of the recipe really used (``actual``)
    and of BF16 layers judged in shadow mode (``shadow``); what-if variants are left out.

    Returns ``(labels, steps, m)`` where ``labels`` are ``"<layer>/<tensor>"`` in order of first
    appearance, ``steps`` are sorted, and ``m[i, j]`` is the value of ``stat`` for ``labels[i]``
    at ``steps[j]`` (NaN where not sampled; the last row wins if a cell repeats).
    """
    import numpy as np

    cells: dict[tuple[str, int], float] = {}
    labels: dict[str, None] = {}
    steps: set[int] = set()
    for r in rows:
        if r.variant not in variants or stat not in r.stats:
            continue
        label = f"{r.layer}/{r.tensor}"
        labels.setdefault(label, None)
        steps.add(int(r.step))
        v = r.stats[stat]
        cells[(label, int(r.step))] = float(v) if v is not None else math.nan
    label_list, step_list = list(labels), sorted(steps)
    m = np.full((len(label_list), len(step_list)), np.nan)
    li = {lab: i for i, lab in enumerate(label_list)}
    si = {s: j for j, s in enumerate(step_list)}
    for (lab, s), v in cells.items():
        m[li[lab], si[s]] = v
    return label_list, step_list, m


def heatmap_figure(rows: Sequence[TensorStatsRow], stats: Sequence[str] = ("underflow_pct", "mse")) -> Figure | None:
    """One heatmap panel per statistic (rows: layer/tensor, columns: steps); ``mse`` is shown as
    log10 because it spans decades. ``None`` when no row has any of ``stats``.

    Uses ``matplotlib.figure.Figure`` directly: no pyplot, no global backend change.
    """
    import numpy as np
    from matplotlib.figure import Figure

    panels = [(s, *heatmap_matrix(rows, s)) for s in stats]
    panels = [p for p in panels if p[1]]
    if not panels:
        return None
    n_labels = max(len(p[1]) for p in panels)
    fig = Figure(figsize=(10, 1.5 + 0.3 * n_labels * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, (stat, labels, steps, m) in zip(axes, panels, strict=True):
        title = stat
        if stat == "mse":
            with np.errstate(divide="ignore", invalid="ignore"):
                m = np.log10(np.where(m > 0, m, np.nan))
            title = "log10(mse)"
        im = ax.imshow(m, aspect="auto", interpolation="nearest", cmap="viridis")
        ax.set_title(f"{title} by layer over steps")
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ticks = np.linspace(0, len(steps) - 1, num=min(len(steps), 10)).round().astype(int)
        ax.set_xticks(ticks, [str(steps[i]) for i in ticks], fontsize=7)
        ax.set_xlabel("step")
        fig.colorbar(im, ax=ax)
    return fig


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
        table_every_n_steps: write buffered table rows every n logged steps (0 = only at finish).
        heatmap: log ``fp8_heatmap.png`` (underflow and MSE by layer over steps) at finish.
        heatmap_stats: the statistics shown in the heatmap.
        name: tracker name (missed-step file name).
        background, max_queue, finish_timeout_s: see :class:`~fp8track.trackers.base.QueuedTracker`.

    Raises:
        ConfigError: bad ``table_every_n_steps``, or a ``file:`` tracking URI (MLflow >= 3.13
            refuses the file store; use ``sqlite:///<path>``).
    """

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
        heatmap: bool = True,
        heatmap_stats: Sequence[str] = ("underflow_pct", "mse"),
        name: str = "mlflow",
        background: bool = True,
        max_queue: int = 1000,
        finish_timeout_s: float = 600.0,
    ) -> None:
        super().__init__(background=background, max_queue=max_queue, finish_timeout_s=finish_timeout_s)
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
        self._keys: dict[str, str] = {}  # raw name -> sanitised key (names repeat every step)
        self._rows: list[TensorStatsRow] = []  # every tensor row, for the heatmap
        self._unwritten_rows: list[TensorStatsRow] = []
        self._events: dict[str, list[list[Any]]] = {}
        self._steps_since_tables = 0
        self.worst_event: EventRecord | None = None

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
        """Params ``fp8.recipe.*``, ``fp8.bf16_layers``, ``fp8.fp8_layers``; tags ``fp8.recipe``
        (the recipe's name), ``fp8.n_bf16_layers``, ``fp8track.run_id``, ``fp8track.version.*``."""
        from mlflow.entities import Param, RunTag

        run_id = self._ensure_run()
        m = asdict(meta)
        recipe = m["recipe"] or {}
        params = flatten("fp8.recipe", recipe) if recipe else {}
        params["fp8.bf16_layers"] = ",".join(m["bf16_layers"]) or "none"
        params["fp8.fp8_layers"] = ",".join(m["fp8_layers"]) or "none"
        params.update(flatten("fp8track.config", m["config"]) if m["config"] else {})
        tags = {
            "fp8.recipe": str(recipe.get("name", json.dumps(recipe, sort_keys=True) if recipe else "none")),
            "fp8.n_bf16_layers": str(len(m["bf16_layers"])),
            "fp8track.run_id": str(m["run_id"]),
        }
        tags.update(flatten("fp8track.version", m["versions"]))
        p = [Param(sanitize_key(k), v[:MAX_PARAM_VALUE_LEN]) for k, v in params.items()]
        t = [RunTag(sanitize_key(k), v[:MAX_TAG_VALUE_LEN]) for k, v in tags.items()]
        for i in range(0, max(len(p), len(t)), MAX_PARAMS_TAGS_PER_BATCH):
            chunk = slice(i, i + MAX_PARAMS_TAGS_PER_BATCH)
            self.client.log_batch(run_id, params=p[chunk], tags=t[chunk], synchronous=True)

    # -- per step (worker thread) -------------------------------------------------------------
    def _key(self, name: str) -> str:
        key = self._keys.get(name)
        if key is None:
            key = self._keys[name] = sanitize_key(name)
        return key

    def _deliver(self, batch: StepBatch) -> None:
        from mlflow.entities import Metric

        run_id = self._ensure_run()
        ts = int(time.time() * 1000)
        step = batch.step
        metrics = [Metric(self._key(k), v, ts, step) for k, v in scalar_metrics(batch.metrics).items()]
        for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            self.client.log_batch(run_id, metrics=metrics[i : i + MAX_METRICS_PER_BATCH], synchronous=True)
        if batch.tensor_rows:
            self._rows.extend(batch.tensor_rows)
            self._unwritten_rows.extend(batch.tensor_rows)
        new_worst = None
        for ev in batch.events:
            key = EVENT_TABLES.get(ev.kind)
            if key is not None:
                self._events.setdefault(key, []).append(event_row(ev))
            if event_severity(ev) > -math.inf and (
                self.worst_event is None or event_severity(ev) > event_severity(self.worst_event)
            ):
                self.worst_event = new_worst = ev
        if new_worst is not None:
            self._tag_worst(new_worst)
        self._steps_since_tables += 1
        if self.table_every_n_steps and self._steps_since_tables >= self.table_every_n_steps:
            self._write_tables()

    def _tag_worst(self, ev: EventRecord) -> None:
        d = ev.data
        tags = {
            "fp8.worst_event.kind": ev.kind,
            "fp8.worst_event.step": str(ev.step),
            "fp8.worst_event.severity": repr(event_severity(ev)),
            "fp8.worst_event.title": str(d.get("title", "")),
            "fp8.worst_event.layer": str(d.get("layer", "")),
        }
        from mlflow.entities import RunTag

        self.client.log_batch(
            self._ensure_run(), tags=[RunTag(k, v[:MAX_TAG_VALUE_LEN]) for k, v in tags.items()], synchronous=True
        )

    def _write_tables(self) -> None:
        import pandas as pd

        run_id = self._ensure_run()
        self._steps_since_tables = 0
        if self._unwritten_rows:
            rows = self._unwritten_rows
            cols = tensor_stat_columns(rows)
            df = pd.DataFrame(
                [[r.step, r.layer, r.tensor, r.variant, *(r.stats.get(c) for c in cols)] for r in rows],
                columns=[*TENSOR_KEY_COLUMNS, *cols],
            )
            self.client.log_table(run_id, data=df, artifact_file=f"{naming.TABLE_TENSOR_STATS}.json")
            self._unwritten_rows = []
        for key, event_rows in list(self._events.items()):
            if event_rows:
                df = pd.DataFrame(event_rows, columns=list(EVENT_COLUMNS))
                self.client.log_table(run_id, data=df, artifact_file=f"{key}.json")
                self._events[key] = []

    def _close(self) -> None:
        run_id = self._ensure_run()
        try:
            self._write_tables()
        except Exception as exc:
            # The rows are lost with this process unless replayed: name their steps.
            steps = {r.step for r in self._unwritten_rows} | {row[0] for rows in self._events.values() for row in rows}
            for step in sorted(steps):
                self._record_failure(step, TablesNotWritten(exc))
            raise
        if self.heatmap and self._rows:
            fig = heatmap_figure(self._rows, self.heatmap_stats)
            if fig is not None:
                self.client.log_figure(run_id, fig, HEATMAP_FILE)
        if self.own_run:
            self.client.set_terminated(run_id, "FINISHED")
