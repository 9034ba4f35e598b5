"""MLflow: the tracker (a view of the run directory in one MLflow run) and its reader, one module
per job:

* ``writer``: :class:`MLflowTracker` (metrics per step from a background worker, tables, params
  and tags, the worst event, the heatmap figure);
* ``params``: the run's params and tags (:func:`run_params`, :func:`run_tags`) and the
  ``fp8track_meta.json`` artifact's name;
* ``spool``: :class:`TableSpool`, table rows waiting on local disk for the next table write;
* ``reader``: :func:`read_mlflow_run`, a run read back (beside its writer);
* ``client``: :class:`RetryingClient` (MLflow calls retried while a store is busy or unreachable,
  for the sweep executor) and :func:`transient_mlflow_error`.

The heatmap itself is :mod:`fp8track.trackers.heatmap`, shared with the HTML report. ``mlflow`` is
imported only when a tracker, a client or a reader is used.
"""

from fp8track.monitoring.naming import sanitize_key
from fp8track.trackers.heatmap import HeatmapSummary, heatmap_figure, heatmap_matrix
from fp8track.trackers.mlflow.client import RetryingClient, transient_mlflow_error
from fp8track.trackers.mlflow.params import (
    META_ARTIFACT,
    applicable_recipe_fields,
    flatten,
    name_list,
    run_params,
    run_tags,
    unflatten,
)
from fp8track.trackers.mlflow.reader import read_mlflow_run
from fp8track.trackers.mlflow.spool import TableSpool
from fp8track.trackers.mlflow.writer import HEATMAP_FILE, MAX_METRICS_PER_BATCH, MLflowTracker

__all__ = [
    "MLflowTracker",
    "HEATMAP_FILE",
    "MAX_METRICS_PER_BATCH",
    "META_ARTIFACT",
    "run_params",
    "run_tags",
    "name_list",
    "flatten",
    "unflatten",
    "applicable_recipe_fields",
    "sanitize_key",
    "TableSpool",
    "read_mlflow_run",
    "RetryingClient",
    "transient_mlflow_error",
    "HeatmapSummary",
    "heatmap_matrix",
    "heatmap_figure",
]
