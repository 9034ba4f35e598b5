"""Where to look at a sweep in the MLflow UI: the experiment's runs and the trials' compare view.

MLflow 3's UI keeps a per-browser "workflow" switch (GenAI / Model training, default GenAI) and
opens ``#/experiments/<id>`` on the GenAI overview under the default, whatever the experiment's
``mlflow.experimentKind`` tag says; the ``workflowType=machine_learning`` query parameter (read
before the browser's stored choice) and the ``/runs`` tab route open it on its runs
(``mlflow/server/js``: ``WorkflowTypeProvider``, ``getExperimentPageTabRoute``)."""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import quote

DEFAULT_UI = "http://127.0.0.1:5000"
"""Where ``mlflow ui`` serves by default."""

MAX_COMPARED = 100
"""Runs put in the compare link (the most recent trials): longer URLs and tables help nobody."""


def ui_base(tracking_uri: str) -> str:
    """The UI's address: the tracking server itself, else where ``mlflow ui`` serves a local store."""
    return tracking_uri.rstrip("/") if tracking_uri.startswith(("http://", "https://")) else DEFAULT_UI


def experiment_runs_url(base: str, experiment_id: str) -> str:
    """The experiment opened on its runs table (not the GenAI overview).

    Example:
        >>> experiment_runs_url("http://127.0.0.1:5000", "3")
        'http://127.0.0.1:5000/#/experiments/3/runs?workflowType=machine_learning'
    """
    return f"{base}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"


def compare_url(base: str, experiment_id: str, run_ids: Sequence[str]) -> str:
    """MLflow's compare view of ``run_ids`` (its last :data:`MAX_COMPARED`): params, metrics and
    the parallel-coordinates plot of the trials.

    Example:
        >>> compare_url("http://h:5000", "3", ["a", "b"])
        'http://h:5000/#/compare-runs?runs=%5B%22a%22%2C%22b%22%5D&experiments=%5B%223%22%5D'
    """
    runs = quote(json.dumps(list(run_ids)[-MAX_COMPARED:], separators=(",", ":")))
    return f"{base}/#/compare-runs?runs={runs}&experiments={quote(json.dumps([experiment_id]))}"


def mlflow_ui_command(tracking_uri: str) -> str:
    """``<mlflow> ui --backend-store-uri <uri>`` runnable as printed: the ``mlflow`` script beside
    this interpreter (``.venv/bin/mlflow`` of a virtual environment nobody activated; relative when
    under the working directory), else ``mlflow`` from the ``PATH``."""
    script = Path(sys.executable).parent / "mlflow"  # not resolved: a venv's python is a symlink
    if script.is_file():
        rel = os.path.relpath(script)
        exe = rel if not rel.startswith("..") else str(script)
    else:
        exe = "mlflow"
    return f"{shlex.quote(exe)} ui --backend-store-uri {shlex.quote(tracking_uri)}"


def how_to_look(tracking_uri: str, experiment_id: str, trial_run_ids: Sequence[str]) -> str:
    """The lines the CLI prints after a sweep: how to start the UI (a local store) and the two links."""
    base = ui_base(tracking_uri)
    local = base != tracking_uri.rstrip("/")
    lines = [f"Look at it: {mlflow_ui_command(tracking_uri)}  then open" if local
             else "Look at it in the MLflow UI:"]
    lines.append(f"  runs:    {experiment_runs_url(base, experiment_id)}")
    if trial_run_ids:
        lines.append(f"  compare: {compare_url(base, experiment_id, trial_run_ids)}")
    return "\n".join(lines)


def sweep_links(tracking_uri: str, name: str) -> str:
    """:func:`how_to_look` for the sweep ``name`` in the store at ``tracking_uri``: its experiment
    and its trials, oldest first."""
    from mlflow.tracking import MlflowClient

    from fp8track.sweep.mlflow_runs import find_parent, trial_run_ids

    client = MlflowClient(tracking_uri)
    exp_id, parent = find_parent(client, name)
    return how_to_look(tracking_uri, exp_id, trial_run_ids(client, exp_id, parent))
