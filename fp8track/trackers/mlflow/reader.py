"""Reading back a run the MLflow tracker (or any MLflow logger) wrote: the reader beside its writer
(:func:`read_mlflow_run` -> :class:`fp8track.trackers.base.StoredRun`)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fp8track.errors import ConfigError
from fp8track.monitoring import naming
from fp8track.monitoring.records import TensorStatsRow
from fp8track.trackers.base import TENSOR_KEY_COLUMNS, StoredRun, rows_from_scalars
from fp8track.trackers.mlflow.params import META_ARTIFACT, unflatten

if TYPE_CHECKING:
    from mlflow import MlflowClient


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


def _require_sqlite_file(run_id: str, tracking_uri: str) -> None:
    """Reading from a ``sqlite:///`` store that does not exist would create an empty database there
    (MLflow makes and migrates it on first use) before finding no run: refuse it instead."""
    if not tracking_uri.lower().startswith("sqlite:"):
        return
    from sqlalchemy.engine import make_url

    path = make_url(tracking_uri).database
    if path and path != ":memory:" and not os.path.isfile(path):
        raise ConfigError(f"run 'mlflow:{run_id}': no such run at {tracking_uri}: no MLflow database there "
                          f"({path!r} does not exist); give the tracking URI the run was logged to")


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
    _require_sqlite_file(run_id, tracking_uri)
    client = MlflowClient(tracking_uri=tracking_uri)
    try:
        run = client.get_run(run_id)
    except MlflowException as err:
        # from None: the cause's text names the URI with its password; the message is redacted
        raise ConfigError(f"run 'mlflow:{run_id}': no such run at {tracking_uri} ({err})") from None
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
