"""``fp8track sweep`` when things go wrong, with real subprocesses (``tests/sweep_programs``):
refused input stops the sweep at once in one line (no Optuna traceback, nothing cached that should
not be), failed trials are listed with their reason (one that failed before its run existed too),
no configuration runs twice and the budget counts distinct ones, a hung trial is stopped by the
per-trial timeout, SIGTERM / Ctrl-C stop the running trial and close every MLflow run, and a sweep
name cannot write outside ``./fp8track-sweep``."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytest.importorskip("optuna")
pytest.importorskip("mlflow")

from integration.test_sweep import cli, runs, sweep_yaml  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _eager_stats(monkeypatch) -> None:
    monkeypatch.setenv("FP8TRACK_STATS_KERNEL", "eager")


def _errors(err: str) -> list[str]:
    """stderr's lines but MLflow's and Optuna's INFO notes (store and study created)."""
    info = re.compile(r"^(\d{4}/\d\d/\d\d \S+ INFO |\[I \d{4}-)")
    return [line for line in err.splitlines() if line.strip() and not info.match(line)]


def _study(out: Path, name: str):
    import optuna

    return optuna.load_study(study_name=name, storage=f"sqlite:///{out / 'optuna.db'}")


def _no_run_left_running(out: Path) -> list[str]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    exps = [e.experiment_id for e in client.search_experiments()]
    return [r.info.status for r in client.search_runs(exps)]


@pytest.mark.parametrize("silent_on", ["bf16", "current"])
def test_a_run_without_the_metric_stops_the_sweep_in_one_line(tmp_path: Path, capsys, silent_on) -> None:
    """The control (``bf16``) or the first trial (``current``) logs no ``val/loss``: exit 2, one
    line on stderr, no traceback (Optuna's own log of the failed trial is silenced); the refused
    control is not cached; no run is left RUNNING."""
    path = sweep_yaml(tmp_path, "silent", recipe=["current"], bf16_layers=["none", "last:1"], steps=2,
                      seed=0, silent_on=silent_on)
    out = tmp_path / "out"
    assert cli(str(path), "--trials", "2", "--out", str(out)) == 2
    err = _errors(capsys.readouterr().err)
    assert len(err) == 1 and err[0].startswith("fp8track sweep: error: "), err
    assert "without logging the sweep's metric 'val/loss'" in err[0] and "train/loss" in err[0]
    cached = sorted((out / "cache").glob("run-*.json"))
    assert len(cached) == (0 if silent_on == "bf16" else 1)  # only a control that logged it
    assert set(_no_run_left_running(out)) <= {"FINISHED", "FAILED"}


def test_failed_trials_are_listed_with_their_reason_even_before_their_run_existed(tmp_path: Path) -> None:
    """Seed 1's control fails, so the seed-1 trials fail before their program (no child run), the
    first trial among them (grid order of ``--seed 1``). Every failed trial is in the summary with
    why."""
    path = sweep_yaml(tmp_path, "failing", recipe=["current", "mxfp8"], bf16_layers=["none"], steps=2,
                      seed=[0, 1], fail_on="bf16@1")
    out = tmp_path / "out"
    assert cli(str(path), "--trials", "2", "--seed", "1", "--out", str(out), "--control-seeds", "1",
               "--finalists", "1") == 0
    study = _study(out, "failing")
    failed = {t.number: t for t in study.trials if t.state.name == "FAIL"}
    assert failed, [(t.number, t.params, t.state.name) for t in study.trials]
    client, _, parent, found = runs(out, "failing")
    text = Path(client.download_artifacts(parent, "summary.txt", str(tmp_path))).read_text()
    listed = text.split("Failed trials:")[1]
    why = "the BF16 control failed"
    for n in failed:
        assert f"trial {n}: " in listed and why in listed.split(f"trial {n}: ")[1].splitlines()[0], text
    assert 0 in failed and {t.params["seed"] for t in failed.values()} == {1}
    assert {int(r.data.tags["fp8track.trial"]) for r in found}.isdisjoint(failed)  # no child run


def test_no_configuration_runs_twice_and_the_budget_counts_distinct_ones(tmp_path: Path, capsys) -> None:
    """Random sampling with seed 2 proposes ``mxfp8`` for trials 0 and 1 (a two-point space): trial
    1 runs nothing (``duplicate_of`` 0, no child run, no program) and ``current`` is queued instead;
    ``--trials 5`` is capped at the space's 2 points. The progress line's best gap is the smallest
    ``gap_vs_bf16``, not a metric value."""
    from fp8track.cli import main

    path = sweep_yaml(tmp_path, "dups", method="random", recipe=["current", "mxfp8"], bf16_layers="none",
                      steps=2, seed=0)
    out = tmp_path / "out"
    assert main(["sweep", str(path), "--trials", "5", "--seed", "2", "--out", str(out),
                 "--control-seeds", "1", "--finalists", "1"]) == 0
    err = capsys.readouterr().err
    study = _study(out, "dups")
    dups = [t for t in study.trials if t.user_attrs.get("duplicate_of") is not None]
    assert [(t.number, t.user_attrs["duplicate_of"]) for t in dups] == [(1, 0)]
    client, _, _, found = runs(out, "dups")
    assert sorted(r.data.params["recipe"] for r in found) == ["current", "mxfp8"]
    assert len(list((out / "logs").glob("*.log"))) == 3  # the control and two trials, nothing twice
    gaps = {int(r.data.tags["fp8track.trial"]): r.data.metrics["gap_vs_bf16"] for r in found}
    best = min(gaps, key=gaps.get)
    assert f"best gap {gaps[best]:+.4f} (trial {best})" in err, err[-600:]
    assert abs(gaps[best]) < 0.1  # a gap of a few thousandths, not val/loss (about 2)


def test_a_refused_configuration_runs_once_and_the_sweep_finishes_on_the_others(tmp_path: Path) -> None:
    """A grid of three recipes, the program refusing ``mxfp8`` (a ``ConfigError``, as for a
    ``bf16_layers`` term naming no layer of the model), no ``--trials`` (the whole grid): mxfp8 runs
    once, is listed under "Failed trials:" with its reason, and the two other points give the summary
    and a recommendation. Before, every re-proposal of the refused point ran it again (the grid
    re-draws failed points, the executor queued it as unevaluated): 4 mxfp8 runs, "three trials in a
    row failed", exit 2 and no summary."""
    path = sweep_yaml(tmp_path, "refusing", recipe=["current", "mxfp8", "block"], bf16_layers="none",
                      steps=2, seed=0, refuse_on="mxfp8")
    out = tmp_path / "out"
    assert cli(str(path), "--out", str(out), "--control-seeds", "1", "--finalists", "1") == 0
    study = _study(out, "refusing")
    ran = [t for t in study.trials if t.user_attrs.get("duplicate_of") is None]
    assert sorted(t.params["recipe"] for t in ran) == ["block", "current", "mxfp8"]
    assert [t.state.name for t in ran if t.params["recipe"] == "mxfp8"] == ["FAIL"]
    client, _, parent, found = runs(out, "refusing")
    assert sorted(r.data.params["recipe"] for r in found) == ["block", "current", "mxfp8"]
    assert len(list((out / "logs").glob("*.log"))) == 4  # the control and three trials, nothing twice
    text = Path(client.download_artifacts(parent, "summary.txt", str(tmp_path))).read_text()
    assert "planted refusal: mxfp8" in text.split("Failed trials:")[1], text
    assert "Recommendation: recipe current" in text, text


def test_a_hung_trial_is_stopped_by_the_timeout_and_the_sweep_goes_on(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    path = sweep_yaml(tmp_path, "hung", recipe=["current", "mxfp8", "delayed"], bf16_layers=["none"],
                      steps=2, seed=0, hang_on="mxfp8", pid_dir=str(pids))
    out = tmp_path / "out"
    t0 = time.monotonic()
    assert cli(str(path), "--trials", "2", "--out", str(out), "--control-seeds", "1", "--finalists", "1",
               "--trial-timeout", "20", "--kill-grace", "1") == 0
    assert time.monotonic() - t0 < 300
    client, _, _, found = runs(out, "hung")
    hung = [r for r in found if r.data.params["recipe"] == "mxfp8"]
    assert len(hung) == 1 and hung[0].info.status == "FAILED", [r.data.params for r in found]
    assert hung[0].data.tags["fp8track.error"].startswith("timed out after 20 s")
    pid = int((pids / f"{hung[0].info.run_id}.pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert sum(r.info.status == "FINISHED" for r in found) == 2


@pytest.mark.parametrize("timeout", ["0", "nan", "-1"])
def test_a_bad_trial_timeout_is_one_line(tmp_path: Path, capsys, timeout) -> None:
    path = sweep_yaml(tmp_path, "t", recipe=["current"], bf16_layers=["none"], steps=2, seed=0)
    assert cli(str(path), "--trials", "1", "--out", str(tmp_path / "out"), "--trial-timeout", timeout) == 2
    err = _errors(capsys.readouterr().err)
    assert len(err) == 1 and "trial_timeout_s must be a finite number of seconds > 0" in err[0], err
    assert not (tmp_path / "out").exists()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_running_trial_and_closes_every_run(tmp_path: Path, sig) -> None:
    """SIGTERM (or Ctrl-C's SIGINT) to ``fp8track sweep`` while a trial trains: the trial's program
    (in its own process group) is stopped, not orphaned; one line, exit 128 + signal, no traceback;
    the parent, control and trial runs are closed (KILLED / FINISHED), none RUNNING; the same
    command resumes and finishes the sweep."""
    pids = tmp_path / "pids"
    pids.mkdir()
    path = sweep_yaml(tmp_path, "sig", recipe=["current", "mxfp8"], bf16_layers=["none"], steps=12,
                      sleep=0.5, seed=0, pid_dir=str(pids))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "fp8track.cli", "sweep", str(path), "--trials", "1", "--out", str(out),
           "--no-progress", "--control-seeds", "1", "--finalists", "0", "--kill-grace", "2"]
    env = {**os.environ, "FP8TRACK_STATS_KERNEL": "eager"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 240
    while len(list(pids.glob("*.pid"))) < 2:  # the control, then the trial started
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.3)
    time.sleep(1.0)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err
    lines = _errors(err)
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith(f"fp8track sweep: interrupted ({sig.name})")
    for p in pids.glob("*.pid"):
        assert not _alive(int(p.read_text())), p.name
    statuses = _no_run_left_running(out)
    assert "RUNNING" not in statuses and statuses.count("KILLED") == 2, statuses  # trial + parent
    # the same command resumes it: the parent is RUNNING again, then FINISHED with a summary
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    client, _, parent, _ = runs(out, "sig")
    assert client.get_run(parent).info.status == "FINISHED"


def test_a_sweep_name_cannot_leave_the_output_folder(tmp_path: Path, monkeypatch) -> None:
    work = tmp_path / "a" / "b" / "c"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    path = sweep_yaml(work, "x", recipe=["current"], bf16_layers=["none"], steps=2, seed=0)
    body = yaml.safe_load(path.read_text()) | {"name": "../../../escape"}
    path.write_text(yaml.safe_dump(body))
    assert cli(str(path), "--trials", "1", "--control-seeds", "1", "--finalists", "0") == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # nothing written up there
    assert (work / "fp8track-sweep" / "escape" / "mlflow.db").is_file()
    assert sorted(p.name for p in (work / "fp8track-sweep").iterdir()) == ["escape"]
    assert cli(str(path), "--summary") == 0  # found again under the same folder
