"""MLflow adapter.

Per step, one ``log_batch`` (chunks of at most 1000 metrics, MLflow's per-request limit) is made
from a background worker, so the training thread only enqueues. Names are sanitised to the
characters MLflow accepts by :func:`fp8track.monitoring.naming.sanitize_key`. Per-layer rows and
events go to a spool file on local disk as they arrive (:class:`TableSpool`) and are written as
the table artifacts MLflow's ``log_table`` writes, once at the end (or every
``table_every_n_steps``; each write uploads the whole table, so not every step). Memory holds no
table row: ``log_table`` itself appends by downloading the table and rewriting it in pandas,
which would hold the whole table in memory on every write. The recipe goes to params and tags
(``fp8.recipe``...), the most severe event to tags ``fp8.worst_event.*``, and a per-layer heatmap
of underflow and MSE over steps to ``fp8_heatmap.png`` via ``log_figure``.

``mlflow`` is imported only when a tracker is built.
"""

from __future__ import annotations

import bisect
import json
import math
import shutil
import tempfile
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fp8track.errors import ConfigError, check_int
from fp8track.execution.recipes import RECIPE_OPTIONS
from fp8track.monitoring import naming
from fp8track.monitoring.naming import sanitize_key
from fp8track.monitoring.records import EventRecord, RunMeta, TensorStatsRow, redact
from fp8track.optional import require
from fp8track.trackers.base import (
    EVENT_COLUMNS,
    EVENT_TABLES,
    TENSOR_KEY_COLUMNS,
    QueuedTracker,
    StepBatch,
    StoredRun,
    TablesNotWritten,
    call_with_backoff,
    event_row,
    event_severity,
    rows_from_scalars,
    scalar_metrics,
    tensor_stat_columns,
)
from fp8track.trackers.expert_views import EXPERT_HEATMAP_FILE, ExpertHeatmap, layer_rows

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


def applicable_recipe_fields(recipe: Mapping[str, Any]) -> dict[str, Any]:
    """The recipe's fields that apply to it (``RECIPE_OPTIONS``, the recipe grammar's own table):
    only ``name`` for ``bf16``; the amax history only for ``delayed``; ``margin`` for per-tensor
    scaling; ``variant`` for ``current``; the NVFP4 switches for ``nvfp4``. The rest would be
    compare-view axes a run never used (a BF16 control has no amax history)."""
    name = recipe.get("name")
    if name == "bf16":
        return {"name": name}
    options = {o for opts in RECIPE_OPTIONS.values() for o in opts}
    used = set(RECIPE_OPTIONS.get(str(name), options))
    return {k: v for k, v in recipe.items() if k not in options or k in used}


META_ARTIFACT = "fp8track_meta.json"
"""The run's whole :class:`RunMeta` (config, apply report, data fingerprint, full layer lists)."""


def run_params(meta: RunMeta) -> dict[str, str]:
    """The monitor's MLflow params: the compare view's axes, so short and only those that apply.

    * ``fp8.recipe.*``: :func:`applicable_recipe_fields` (a BF16 control or a current-scaling run
      has no amax history);
    * ``fp8.backend``, ``fp8.n_bf16_layers``, ``fp8.n_fp8_layers``: when the model went through
      :func:`fp8track.apply_fp8` (counts, not lists: a comma list of layer names is cut to a few
      characters on a compare-view axis; the lists are tags, the whole set the artifact);
    * ``fp8track.precision.*``: what the run enabled around precision (strategy, compile, ...),
      values that are set (no ``None``) except the recipe, which ``fp8.recipe.*`` already holds.

    The monitor's own settings, the apply report and the data fingerprint are in
    :data:`META_ARTIFACT`, not params.
    """
    recipe = dict(meta.recipe or {})
    params = flatten("fp8.recipe", applicable_recipe_fields(recipe)) if recipe else {}
    config = dict(meta.config or {})
    apply = config.get("apply")
    if isinstance(apply, Mapping) and apply.get("backend"):
        params["fp8.backend"] = str(apply["backend"])
    if recipe:
        params["fp8.n_bf16_layers"] = str(len(meta.bf16_layers))
        params["fp8.n_fp8_layers"] = str(len(meta.fp8_layers))
    precision = config.get("precision")
    if isinstance(precision, Mapping):
        params.update(flatten("fp8track.precision", {
            k: v for k, v in precision.items() if v is not None and k != "recipe"}))
    return params


def name_list(names: Sequence[str], limit: int = MAX_TAG_VALUE_LEN) -> str:
    """``names`` joined by commas, cut at a whole name to fit ``limit`` characters with the count
    of those left out (the full list is in :data:`META_ARTIFACT`); ``"none"`` when empty.

    Example:
        >>> name_list(["layer.0", "layer.1", "layer.2"], limit=20)
        'layer.0 (+2 more)'
    """
    text = ",".join(names)
    if len(text) <= limit:
        return text or "none"
    end = -1  # length of the names kept so far, with their commas
    for i, name in enumerate(names):
        end += len(name) + 1
        if end + len(f" (+{len(names) - i - 1} more)") > limit:
            return (",".join(names[:i]) + f" (+{len(names) - i} more)").lstrip()
    return text  # unreachable: the whole text is longer than the limit


def run_tags(meta: RunMeta) -> dict[str, str]:
    """The monitor's MLflow tags: ``fp8.recipe`` (the recipe's name), ``fp8.bf16_layers`` and
    ``fp8.fp8_layers`` (the layer lists, :func:`name_list`), ``fp8track.run_id``,
    ``fp8track.version.*``."""
    recipe = dict(meta.recipe or {})
    tags = {
        "fp8.recipe": str(recipe.get("name", json.dumps(recipe, sort_keys=True) if recipe else "none")),
        "fp8.bf16_layers": name_list(list(meta.bf16_layers)),
        "fp8.fp8_layers": name_list(list(meta.fp8_layers)),
        "fp8track.run_id": str(meta.run_id),
    }
    tags.update(flatten("fp8track.version", dict(meta.versions)))
    return tags


class HeatmapSummary:
    """A fixed-size layer-by-step summary of some statistics, for the heatmap.

    Memory stays bounded over any number of steps: at most ``max_columns`` columns per
    ``"<layer>/<tensor>"`` label. Each column holds consecutive sampled steps (one at first); when
    a step would open one column too many, neighbouring columns are merged pairwise, so each then
    holds twice as many sampled steps. A cell keeps the value of its latest step (the last row
    wins if a step repeats). Only the rows of the recipe really used (``actual``) and of BF16 layers
    judged in shadow mode (``shadow``) are kept; what-if variants are left out.

    Args:
        stats: statistics to keep.
        max_columns: the most columns kept (>= 2).
    """

    VARIANTS = ("actual", "shadow")

    def __init__(self, stats: Sequence[str], max_columns: int = 256) -> None:
        from fp8track.errors import check_int

        check_int("max_columns", max_columns, 2)
        self.stats = tuple(stats)
        self.max_columns = max_columns
        self.starts: list[int] = []  # first step of each column, increasing
        self.span = 1  # sampled steps per column
        self._fill = 0  # sampled steps in the last column so far
        self._last = -1  # largest step seen
        self.labels: dict[str, None] = {}
        self.cells: dict[
            tuple[str, str, int], tuple[int, float]
        ] = {}  # (stat, label, start) -> (step, value)

    def _column(self, step: int) -> int:
        """The start of the column ``step`` belongs to (opening or merging columns as needed)."""
        if step > self._last:
            self._last = step
            if self.starts and self._fill < self.span:
                self._fill += 1
                return self.starts[-1]
            self.starts.append(step)
            self._fill = 1
        elif step < self.starts[0]:  # older than anything shown (a replay): a column in front
            self.starts.insert(0, step)
        if len(self.starts) > self.max_columns:
            self._merge()
        return self.starts[bisect.bisect_right(self.starts, step) - 1]

    def _merge(self) -> None:
        paired = len(self.starts) % 2 == 0
        new = {old: self.starts[i - i % 2] for i, old in enumerate(self.starts)}
        merged: dict[tuple[str, str, int], tuple[int, float]] = {}
        for (stat, label, start), (step, v) in self.cells.items():
            key = (stat, label, new[start])
            if key not in merged or step >= merged[key][0]:  # the later step of a pair wins
                merged[key] = (step, v)
        self.cells = merged
        self._fill = self._fill + self.span if paired else self._fill
        self.starts = self.starts[::2]
        self.span *= 2

    def add(self, rows: Iterable[TensorStatsRow]) -> None:
        for r in rows:
            if r.variant not in self.VARIANTS:
                continue
            step = int(r.step)
            start = self._column(step)
            label = f"{r.layer}/{r.tensor}"
            for stat in self.stats:
                if stat not in r.stats:
                    continue
                self.labels.setdefault(label, None)
                v = r.stats[stat]
                key = (stat, label, start)
                if key not in self.cells or step >= self.cells[key][0]:
                    self.cells[key] = (step, float(v) if v is not None else math.nan)

    def matrix(self, stat: str) -> tuple[list[str], list[int], np.ndarray]:
        """``(labels, steps, m)``: the labels with a value of ``stat`` in order of first
        appearance, the first step of each column, and ``m[i, j]`` (NaN where nothing was sampled)."""
        import numpy as np

        used = {label for (st, label, _s) in self.cells if st == stat}
        labels = [lab for lab in self.labels if lab in used]
        row = {lab: i for i, lab in enumerate(labels)}
        col = {s: j for j, s in enumerate(self.starts)}
        m = np.full((len(labels), len(self.starts)), np.nan)
        for (st, label, start), (_step, v) in self.cells.items():
            if st == stat:
                m[row[label], col[start]] = v
        return labels, list(self.starts), m


MLFLOW_LOGGED_ARTIFACTS = "mlflow.loggedArtifacts"  # mlflow/utils/mlflow_tags.py: lists a run's tables


class TableSpool:
    """One table artifact whose rows wait in a JSON-lines file on local disk, not in memory.

    MLflow's ``MlflowClient.log_table`` appends to an existing table by downloading it, reading it
    into pandas, concatenating the new rows and rewriting it (mlflow 3.x
    ``mlflow/tracking/client.py``), so every write holds the whole table in memory and a long
    run's peak memory grows with the table. Here :meth:`add` appends rows to ``<dir>/<name>.rows``
    and :meth:`export` streams them, one row in memory at a time, into the file ``log_table``
    would write: pandas' ``orient="split"`` JSON, ``{"columns": [...], "data": [[...], ...]}``
    (non-finite numbers as ``null``, as pandas writes them), read back by ``pandas.read_json(...,
    orient="split")`` and ``MlflowClient.load_table``.

    Columns are fixed by the first rows; a column first seen later is appended at the end and
    the earlier rows read ``null`` there (what pandas' concat gives).

    Args:
        directory: where the spool file lives (created if needed).
        name: the table's artifact file name, e.g. ``fp8_tensor_stats.json``.
        columns: the columns, if known before the first row.
    """

    def __init__(self, directory: str | Path, name: str, columns: Sequence[str] = ()) -> None:
        self.name = name
        self.path = Path(directory) / f"{name}.rows"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.columns = list(columns)
        self.rows = 0  # rows in the spool
        self.written = 0  # rows in the spool when the last export was logged
        # (first row, width): rows from `first` on were added with `width` columns. Columns only
        # grow, so this holds one entry per widening; full-width rows are exported as stored.
        self._widths: list[tuple[int, int]] = []

    @property
    def unwritten(self) -> int:
        """Rows added since the last logged export."""
        return self.rows - self.written

    def add_columns(self, names: Iterable[str]) -> None:
        """Append the names not yet in :attr:`columns`."""
        self.columns.extend(n for n in dict.fromkeys(names) if n not in self.columns)

    def add(self, rows: Iterable[Sequence[Any]]) -> None:
        """Append rows (values in :attr:`columns` order; a shorter row reads ``null`` at the end)."""
        lines = [json.dumps([_json_value(v) for v in row]) + "\n" for row in rows]
        with self.path.open("a", encoding="utf-8") as f:
            f.writelines(lines)
        if not self._widths or self._widths[-1][1] != len(self.columns):
            self._widths.append((self.rows, len(self.columns)))
        self.rows += len(lines)

    def prepend(self, table: Mapping[str, Any]) -> None:
        """Put the rows of an existing table (``{"columns", "data"}``, e.g. the artifact of the run
        being resumed) before the spooled rows, matched to :attr:`columns` by name."""
        self.add_columns(table.get("columns", []))
        index = [self.columns.index(c) for c in table.get("columns", [])]
        tmp = self.path.with_suffix(".tmp")
        with tmp.open("w", encoding="utf-8") as out:
            n = 0
            for values in table.get("data", []):
                row: list[Any] = [None] * len(self.columns)
                for i, v in zip(index, values, strict=False):
                    row[i] = _json_value(v)
                out.write(json.dumps(row) + "\n")
                n += 1
            if self.path.exists():
                with self.path.open(encoding="utf-8") as src:
                    shutil.copyfileobj(src, out)
        tmp.replace(self.path)
        self._widths = [
            (0, 0),
            *((first + n, w) for first, w in self._widths),
        ]  # prepended rows: parsed on export
        self.rows += n
        self.written += n

    def _lines(self, start: int = 0) -> Iterable[tuple[str, bool]]:
        """``(line, full_width)`` of the spooled rows from row ``start`` on."""
        if not self.path.exists():
            return
        width, bounds = len(self.columns), [first for first, _ in self._widths[1:]]
        with self.path.open(encoding="utf-8") as f:
            for i, line in enumerate(f):
                if i >= start:
                    segment = bisect.bisect_right(bounds, i)
                    yield line.rstrip("\n"), bool(self._widths) and self._widths[segment][1] == width

    def iter_rows(self, start: int = 0) -> Iterable[list[Any]]:
        """The spooled rows from row ``start`` on, padded to :attr:`columns`."""
        width = len(self.columns)
        for line, _ in self._lines(start):
            row = json.loads(line)
            yield row + [None] * (width - len(row))

    def export(self, directory: str | Path) -> Path:
        """Write ``<directory>/<name>`` (the whole table, split JSON) and return its path."""
        width = len(self.columns)
        out_path = Path(directory) / self.name
        with out_path.open("w", encoding="utf-8") as out:
            out.write('{"columns":' + json.dumps(self.columns) + ',"data":[')
            for i, (line, full) in enumerate(self._lines()):
                if not full:  # added before a column was: pad it
                    row = json.loads(line)
                    line = json.dumps(row + [None] * (width - len(row)))
                out.write("," + line if i else line)
            out.write("]}")
        return out_path


def _json_value(v: Any) -> Any:
    """``v`` as pandas' ``to_json`` writes it: non-finite floats become ``null``."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def heatmap_matrix(
    rows: Iterable[TensorStatsRow], stat: str, max_columns: int = 256
) -> tuple[list[str], list[int], np.ndarray]:
    """Layer-by-step matrix of one statistic over ``rows`` (see :class:`HeatmapSummary`)."""
    summary = HeatmapSummary((stat,), max_columns)
    summary.add(rows)
    return summary.matrix(stat)


def heatmap_figure(
    rows: Sequence[TensorStatsRow] | HeatmapSummary, stats: Sequence[str] = ("underflow_pct", "mse")
) -> Figure | None:
    """One heatmap panel per statistic (rows: layer/tensor, columns: steps); ``mse`` is shown as
    log10 because it spans decades. ``None`` when no row has any of ``stats``.

    Uses ``matplotlib.figure.Figure`` directly: no pyplot, no global backend change.
    """
    import numpy as np
    from matplotlib.figure import Figure

    summary = rows
    if not isinstance(summary, HeatmapSummary):
        summary = HeatmapSummary(stats)
        summary.add(rows)
    panels = [(s, *summary.matrix(s)) for s in stats]
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


def transient_mlflow_error(exc: BaseException) -> bool:
    """A request that did not reach the server or that the server could not serve now (connection
    and time-out errors, MLflow's "API request ... failed", HTTP 429/502/503/504, a SQLite store
    locked by another process's write): a retry may cure it. Anything else (a bad value, no such
    run, a server error) is not transient."""
    if isinstance(exc, (ConnectionError, TimeoutError, OSError)) or "database is locked" in str(exc):
        return True
    try:
        from mlflow.exceptions import MlflowException
    except ImportError:
        return False
    if not isinstance(exc, MlflowException):
        return False
    return (
        str(exc).startswith("API request to")
        or exc.error_code in ("TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED")
        or exc.get_http_status_code() in (429, 502, 503, 504)
    )


class RetryingClient:
    """An ``MlflowClient`` whose calls are retried on :func:`transient_mlflow_error` with
    exponential back-off (``initial_s`` doubling up to 2 s) for up to ``for_s`` seconds
    (:func:`fp8track.trackers.base.call_with_backoff`), then the error is raised. For callers
    outside a tracker's queue (the sweep executor), where several processes write one SQLite store
    (MLflow waits 20 s for SQLite's lock, ``PRAGMA busy_timeout``, then raises "database is
    locked"). A failed write is rolled back by the store, so a retry cannot write twice."""

    def __init__(self, client: Any, for_s: float = 120.0, initial_s: float = 0.05) -> None:
        self._client, self._for_s, self._initial_s = client, for_s, initial_s
        self.retries = 0  # calls repeated after a transient error, over the client's life

    def _count(self, exc: BaseException) -> None:
        self.retries += 1

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            return call_with_backoff(
                lambda: attr(*args, **kwargs), transient=transient_mlflow_error, for_s=self._for_s,
                initial_s=self._initial_s, max_s=2.0, on_retry=self._count,
            )  # fmt: skip

        return call


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
        heatmap: log ``fp8_heatmap.png`` (underflow and MSE by layer over steps) at finish.
        heatmap_stats: the statistics shown in the heatmap.
        heatmap_columns: step columns of the heatmap (a fixed-size summary, see :class:`HeatmapSummary`).
        name: tracker name (missed-step file name).
        retry_for_s: how long one step is retried while the server is unreachable (default 15
            minutes; the training thread never waits for it).
        background, max_queue, finish_timeout_s, retry_initial_s, retry_max_s: see
            :class:`~fp8track.trackers.base.QueuedTracker`.

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
        retry_for_s: float = 900.0,
        retry_initial_s: float = 0.5,
        retry_max_s: float = 30.0,
    ) -> None:
        super().__init__(
            background=background, max_queue=max_queue, finish_timeout_s=finish_timeout_s,
            retry_for_s=retry_for_s, retry_initial_s=retry_initial_s, retry_max_s=retry_max_s,
        )  # fmt: skip
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
        self._heatmap = HeatmapSummary(self.heatmap_stats, heatmap_columns)
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
                self.worst_event is None or event_severity(ev) > event_severity(self.worst_event)
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
            fig = heatmap_figure(self._heatmap, self.heatmap_stats)
            if fig is not None:
                self.client.log_figure(run_id, fig, HEATMAP_FILE)
        if self.heatmap and (fig := self._experts.figure()) is not None:  # MoE: experts x steps
            self.client.log_figure(run_id, fig, EXPERT_HEATMAP_FILE)
        if self.own_run:
            self.client.set_terminated(run_id, "FINISHED")


# --- reading a run back (the reader beside its writer) -------------------------------------------


def _table_rows(client: Any, run_id: str) -> list[TensorStatsRow]:
    """Rows of the tensor statistics table artifact :class:`MLflowTracker` writes
    (``fp8_tensor_stats.json``); ``[]`` when absent or unreadable."""
    name = f"{naming.TABLE_TENSOR_STATS}.json"
    try:
        if name not in {a.path for a in client.list_artifacts(run_id)}:
            return []
        with tempfile.TemporaryDirectory() as tmp:
            table = json.loads(Path(client.download_artifacts(run_id, name, tmp)).read_text())
    except Exception:  # an unreadable artifact store: the caller falls back to the per-layer scalars
        return []
    cols = table.get("columns", [])
    out = []
    for row in table.get("data", []):
        d = dict(zip(cols, row, strict=False))
        stats = {k: float(v) for k, v in d.items() if k not in TENSOR_KEY_COLUMNS
                 and isinstance(v, (int, float)) and not isinstance(v, bool)}
        out.append(
            TensorStatsRow(
                int(d["step"]), str(d["layer"]), str(d["tensor"]), stats, str(d.get("variant", "actual"))
            )
        )
    return out


def unflatten(flat: Mapping[str, str], prefix: str) -> dict[str, Any]:
    """Inverse of :func:`flatten` for the params under ``prefix``: ``{"p.a.b": "1"}`` ->
    ``{"a": {"b": 1}}`` (values parsed as JSON when they are).

    Example:
        >>> unflatten({"fp8.recipe.name": "delayed", "fp8.recipe.margin": "0", "other": "x"}, "fp8.recipe")
        {'name': 'delayed', 'margin': 0}
    """
    out: dict[str, Any] = {}
    for k, v in flat.items():
        if not k.startswith(prefix + "."):
            continue
        node = out
        *parents, leaf = k[len(prefix) + 1 :].split(".")
        for p in parents:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                break
            node = nxt
        else:
            try:
                node[leaf] = json.loads(v)
            except ValueError:
                node[leaf] = v
    return out


def _stored_meta(client: MlflowClient, run_id: str) -> dict[str, Any]:
    """The run's :data:`META_ARTIFACT`, or ``{}`` when it has none (a run another logger wrote)."""
    if not any(f.path == META_ARTIFACT for f in client.list_artifacts(run_id)):
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(client.download_artifacts(run_id, META_ARTIFACT, tmp)).read_text()
    try:
        out = json.loads(text)
    except ValueError:
        return {}
    return out if isinstance(out, dict) else {}


def read_mlflow_run(run_id: str, tracking_uri: str) -> StoredRun:
    """Read back a run :class:`MLflowTracker` (or any MLflow logger) wrote: every metric's full
    history (several values at one step, e.g. a resumed run: the latest write wins), the tensor
    table (else rows rebuilt from the per-layer scalars), and the metadata from the params and
    tags :meth:`MLflowTracker.start` wrote.

    Raises:
        ConfigError: MLflow is not installed, or there is no such run at ``tracking_uri``.
    """
    try:
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient
    except ImportError as err:
        raise ConfigError("an mlflow: run needs MLflow: pip install 'fp8track[mlflow]'") from err
    client = MlflowClient(tracking_uri=tracking_uri)
    try:
        run = client.get_run(run_id)
    except MlflowException as err:
        raise ConfigError(f"run 'mlflow:{run_id}': no such run at {tracking_uri} ({err})") from err
    metrics: dict[str, dict[int, float]] = {}
    for k in run.data.metrics:
        history = sorted(client.get_metric_history(run_id, k), key=lambda m: (m.step, m.timestamp))
        metrics[k] = {int(m.step): float(m.value) for m in history}
    params = dict(run.data.params)
    stored = _stored_meta(client, run_id)
    meta = {"run_id": run.data.tags.get("fp8track.run_id", run_id), "name": run.info.run_name,
            "recipe": stored.get("recipe") or unflatten(params, "fp8.recipe") or None,
            # runs written before the meta artifact carry the config as params
            "config": stored.get("config") or unflatten(params, "fp8track.config"),
            "mlflow_run_id": run_id}
    rows = _table_rows(client, run_id) or rows_from_scalars(metrics)
    return StoredRun(f"mlflow:{run_id}", metrics, rows, meta)
