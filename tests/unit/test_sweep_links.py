"""The MLflow UI links the sweep prints (``fp8track.sweep.links``); test_mlflow_ui renders them."""

from __future__ import annotations

import json
from urllib.parse import parse_qs, unquote, urlsplit

from fp8track.sweep.links import (
    MAX_COMPARED,
    compare_url,
    experiment_runs_url,
    how_to_look,
    mlflow_ui_command,
    ui_base,
)


def test_ui_base_is_the_server_or_where_mlflow_ui_serves() -> None:
    assert ui_base("http://10.0.0.5:8080/") == "http://10.0.0.5:8080"
    assert ui_base("https://mlflow.example.com") == "https://mlflow.example.com"
    assert ui_base("sqlite:////tmp/x/mlflow.db") == "http://127.0.0.1:5000"


def test_runs_link_opens_the_runs_tab_in_the_training_workflow() -> None:
    fragment = urlsplit(experiment_runs_url("http://h:1", "7")).fragment
    path, query = fragment.split("?")
    assert path == "/experiments/7/runs" and parse_qs(query) == {"workflowType": ["machine_learning"]}


def test_compare_link_holds_the_last_runs_as_json() -> None:
    ids = [f"{i:032x}" for i in range(MAX_COMPARED + 5)]
    query = parse_qs(urlsplit(compare_url("http://h:1", "7", ids)).fragment.split("?", 1)[1])
    assert json.loads(unquote(query["runs"][0])) == ids[5:]  # the most recent MAX_COMPARED
    assert json.loads(unquote(query["experiments"][0])) == ["7"]


def test_how_to_look_starts_mlflow_ui_only_for_a_local_store() -> None:
    local = how_to_look("sqlite:///out/mlflow.db", "1", ["a"]).splitlines()
    assert local[0].startswith(f"Look at it: {mlflow_ui_command('sqlite:///out/mlflow.db')}")
    assert local[0].split()[4:7] == ["ui", "--backend-store-uri", "sqlite:///out/mlflow.db"]
    assert local[1].split()[-1] == experiment_runs_url("http://127.0.0.1:5000", "1")
    assert local[2].split()[-1] == compare_url("http://127.0.0.1:5000", "1", ["a"])
    server = how_to_look("http://srv:5000", "2", []).splitlines()
    runs = experiment_runs_url("http://srv:5000", "2")
    assert server == ["Look at it in the MLflow UI:", f"  runs:    {runs}"]


def test_the_mlflow_command_runs_as_printed_without_an_activated_venv(tmp_path, monkeypatch) -> None:
    """The ``mlflow`` beside this interpreter (a virtual environment's bin folder), relative when
    under the working directory; ``mlflow`` from the PATH when there is none."""
    import sys
    from pathlib import Path

    exe = mlflow_ui_command("sqlite:///x.db").split()[0]
    assert Path(exe).resolve() == (Path(sys.executable).parent / "mlflow").resolve()
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    assert mlflow_ui_command("sqlite:///a b.db") == "mlflow ui --backend-store-uri 'sqlite:///a b.db'"
