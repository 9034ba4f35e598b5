"""``fp8track sweep`` end to end on tiny models: MLflow parent/child runs, the planted fragile layer,
two workers on one SQLite study, and resume after SIGKILL.

Every sweep here trains the example GPT at width 32 for a few dozen steps; the BF16 control and
the ``auto:K`` probe are cached in the sweep's folder, so a second process reuses them.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytest.importorskip("optuna")
pytest.importorskip("mlflow")

TINY = {"steps": 30, "eval_every": 10, "eval_batches": 2, "n_embd": 32, "n_head": 2, "block_size": 32,
        "batch_size": 8, "max_bytes": 200_000, "probe_steps": 6, "every_n_steps": 5, "control_seeds": 2}


def _sweep_file(tmp_path: Path, name: str, bf16_layers: list[str], method: str = "grid", **extra) -> Path:
    params = {"recipe": {"value": "current"}, "bf16_layers": {"values": bf16_layers},
              **{k: {"value": v} for k, v in {**TINY, **extra}.items()}}
    cfg = {"name": name, "program": "fp8track.examples.train", "method": method,
           "metric": {"name": "fp8/val_loss_gap", "goal": "minimize"}, "parameters": params}
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return p


def _children(uri: str, name: str):
    from mlflow.tracking import MlflowClient

    from fp8track.sweep.executor import find_parent

    client = MlflowClient(uri)
    exp_id, parent = find_parent(client, name)
    import mlflow

    mlflow.set_tracking_uri(uri)
    df = mlflow.search_runs(experiment_ids=[exp_id], filter_string=f"tags.mlflow.parentRunId = '{parent}'")
    return client, parent, df


@pytest.mark.slow
def test_planted_fragile_layer_is_found_by_auto1_and_kept_in_bf16(tmp_path: Path) -> None:
    """Acceptance: the layer whose input carries an outlier is auto:1's pick, and the
    recommendation (fewest BF16 layers within the control's seed spread) keeps it in BF16."""
    from fp8track.cli import main

    planted = "model.lm_head"  # the example GPT inside its Lightning module
    path = _sweep_file(tmp_path, "planted", ["none", "auto:1", "last:1"], plant_outlier="lm_head")
    out = tmp_path / "out"
    assert main(["sweep", str(path), "--trials", "3", "--out", str(out), "--no-progress", "--wandb"]) == 0
    uri = f"sqlite:///{out / 'mlflow.db'}"
    client, parent, df = _children(uri, "planted")
    assert len(df) == 3 and set(df["status"]) == {"FINISHED"}
    assert sorted(df["params.bf16_layers"]) == ["auto:1", "last:1", "none"]
    # one type per column, short values, never "None"
    assert set(df["params.n_bf16_layers"]) <= {"0", "1", "4"} and "None" not in df.to_string()
    for col in ("fp8/val_loss_gap", "fp8/val_loss_gap_best", "fp8/spikes/fp8_only", "fp8/spikes/shared",
                "fp8/worst/underflow_pct", "fp8/worst/overflow_pct", "fp8/fp8_layer_share", "fp8/step_time_s"):
        assert df[f"metrics.{col}"].notna().all(), col
    auto = df[df["params.bf16_layers"] == "auto:1"].iloc[0]
    assert auto["tags.fp8track.bf16_layer_names"] == planted
    none = df[df["params.bf16_layers"] == "none"].iloc[0]
    # the planted layer flushes its inputs to zero in FP8: underflow near 100 % only while it runs in FP8
    assert none["metrics.fp8/worst/underflow_pct"] > 90.0 > auto["metrics.fp8/worst/underflow_pct"]
    assert none["metrics.fp8/val_loss_gap"] > auto["metrics.fp8/val_loss_gap"] + 0.5
    run = client.get_run(parent)
    assert run.data.tags["fp8track.recommendation.bf16_layers"] == "auto:1"
    rec = json.loads(Path(client.download_artifacts(parent, "recommendation.json", str(tmp_path))).read_text())
    assert rec["trial"]["n_bf16"] == 1 and rec["trial"]["gap"] <= rec["tolerance"]
    table = json.loads(Path(client.download_artifacts(auto["run_id"], "auto_ranking.json", str(tmp_path))).read_text())
    ranked = dict(zip(table["columns"], table["data"][0], strict=True))
    # the ranking reads the records, whose names are canonical (the Lightning `model.` holder dropped)
    assert ranked["layer"] == planted.removeprefix("model.") and ranked["rank"] == 1
    arts = {a.path for a in client.list_artifacts(parent)}
    assert {"sweep_summary.json", "pareto.png", "recommendation.json", "summary.txt"} <= arts
    # --wandb: one offline run per trial, the gap logged once per evaluation (steps 10, 20, 30)
    from fp8track.analysis.baseline import read_wandb_history

    wandb_runs = sorted((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(wandb_runs) == 3
    history = read_wandb_history(wandb_runs[0])
    assert [r["trainer/global_step"] for r in history if "fp8/val_loss_gap" in r] == [10, 20, 30]
    # --summary reads the same back from the store
    assert main(["sweep", str(path), "--out", str(out), "--summary"]) == 0


def _worker(path: Path, out: Path, trials: int, storage: str, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "fp8track.cli", "sweep", str(path), "--trials", str(trials), "--out", str(out),
           "--storage", storage, "--no-progress", "--heartbeat", "1", "--grace", "3", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=out.parent)


def _trials(db: Path) -> list[tuple[int, str]]:
    with sqlite3.connect(db) as con:
        return con.execute("select number, state from trials order by number").fetchall()


@pytest.mark.slow
def test_two_workers_share_one_sqlite_study(tmp_path: Path) -> None:
    path = _sweep_file(tmp_path, "shared", ["none", "last:1", "first:1", "first_last"], steps=20)
    out = tmp_path / "out"
    out.mkdir()
    storage = f"sqlite:///{out / 'optuna.db'}"
    procs = [_worker(path, out, 3, storage) for _ in range(2)]
    outputs = [p.communicate(timeout=900) for p in procs]
    for p, (_so, se) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, se[-3000:]
    ran = [json.loads(so[so.index("{\n"):so.rindex("}") + 1])["trials_run_here"] for so, _ in outputs]
    finished = [n for n, s in _trials(out / "optuna.db") if s in ("COMPLETE", "PRUNED")]
    failed = [n for n, s in _trials(out / "optuna.db") if s == "FAIL"]
    assert len(finished) == 3
    _client, _parent, df = _children(f"sqlite:///{out / 'mlflow.db'}", "shared")
    errors = {t: e for t, e in zip(df["tags.fp8track.trial"], df.get("tags.fp8track.error", [None] * len(df)), strict=True)
              if isinstance(e, str)}
    # No trial ran twice (on one worker or on both), the workers' trials are exactly the finished
    # ones, and none failed: both workers start together, share the BF16 control (computed once
    # under a file lock) and write one SQLite store (calls retried while another holds its lock).
    both = ran[0] + ran[1]
    assert len(both) == len(set(both))
    assert not failed, errors
    assert sorted(both) == sorted(finished)
    done = df[df["tags.fp8track.state"].isin(["COMPLETE", "PRUNED"])]
    assert sorted(int(t) for t in done["tags.fp8track.trial"]) == sorted(finished)
    assert done["params.bf16_layers"].is_unique  # a grid point never runs twice


def _child_started(db: Path, trial: int) -> bool:
    if not db.exists():
        return False
    try:
        with sqlite3.connect(db) as con:
            return bool(con.execute("select 1 from tags where key = 'fp8track.trial' and value = ?", (str(trial),)).fetchall())
    except sqlite3.OperationalError:  # tables not created yet
        return False


@pytest.mark.slow
def test_resume_after_sigkill_finishes_without_repeating_trials(tmp_path: Path) -> None:
    # Trials long enough (300 steps) that the kill lands inside trial 1 on an idle machine too:
    # with 20 steps a trial could finish between two polls and the kill found nothing running.
    path = _sweep_file(tmp_path, "resume", ["none", "last:1"], steps=300)
    out = tmp_path / "out"
    out.mkdir()
    storage = f"sqlite:///{out / 'optuna.db'}"
    first = _worker(path, out, 2, storage)
    # Kill it once trial 1's MLflow child run exists (trial 0 finished, trial 1 is training).
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and not _child_started(out / "mlflow.db", 1):
        assert first.poll() is None, first.communicate()[1][-3000:]
        time.sleep(0.1)
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    killed = [n for n, s in _trials(out / "optuna.db") if s == "RUNNING"]
    assert len(killed) == 1
    finished_before = [n for n, s in _trials(out / "optuna.db") if s == "COMPLETE"]

    second = _worker(path, out, 2, storage)
    so, se = second.communicate(timeout=900)
    assert second.returncode == 0, se[-3000:]
    states = dict(_trials(out / "optuna.db"))
    assert states[killed[0]] == "FAIL"  # the killed trial is marked failed ...
    done = [n for n, s in states.items() if s == "COMPLETE"]
    assert len(done) == 2 and set(finished_before) <= set(done)
    ran_here = json.loads(so[so.index("{\n"):so.rindex("}") + 1])["trials_run_here"]
    assert not set(ran_here) & set(finished_before)  # ... finished trials are not repeated ...
    _client, _parent, df = _children(f"sqlite:///{out / 'mlflow.db'}", "resume")
    dead = df[df["tags.fp8track.trial"] == str(killed[0])].iloc[0]
    assert dead["status"] == "FAILED" and dead["tags.fp8track.state"] == "FAIL"
    retried = df[df["tags.fp8track.retry_of"] == str(killed[0])]  # ... and retried with its parameters
    assert len(retried) == 1 and retried.iloc[0]["params.bf16_layers"] == dead["params.bf16_layers"]
    assert sorted(df[df["status"] == "FINISHED"]["params.bf16_layers"]) == ["last:1", "none"]
