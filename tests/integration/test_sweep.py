"""``fp8track sweep`` end to end: the YAML's own program as one subprocess per trial, logging into
MLflow child runs; the cached BF16 control; reproducible trials and reused results; the metric
check; pruning that kills the program; two workers on one SQLite study and on a real PostgreSQL
server (Debian's package, started here on 127.0.0.1 in a temporary directory and stopped by its
pid; without PostgreSQL that test skips with the reason, except in CI (``CI`` set), where it
fails: ``make test`` installs ``postgresql`` when run as root, Makefile ``system-deps``).

Programs are scripts under ``tests/sweep_programs`` (not part of the package): ``quadratic.py``
(no model: a known curve per recipe, fast) and ``llama_lightning.py`` (a Hugging Face Llama from a
config, trained by Lightning with ``FP8Monitor``).
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

pytest.importorskip("optuna")
pytest.importorskip("mlflow")

PROGRAMS = Path(__file__).resolve().parents[1] / "sweep_programs"
QUAD = PROGRAMS / "quadratic.py"
LLAMA = PROGRAMS / "llama_lightning.py"


@pytest.fixture(autouse=True)
def _eager_stats(monkeypatch) -> None:
    # Tiny tensors in short-lived trial processes: compiling the statistics kernel in every
    # program would cost more than the run.
    monkeypatch.setenv("FP8TRACK_STATS_KERNEL", "eager")


def sweep_yaml(tmp_path: Path, name: str, program: Path = QUAD, method: str = "grid", **params) -> Path:
    body = {
        "name": name,
        "program": str(program),
        "method": method,
        "metric": {"name": "val/loss", "goal": "minimize"},
        "parameters": {
            k: ({"values": v} if isinstance(v, list) else {"value": v}) for k, v in params.items()
        },
    }
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(body, sort_keys=False))
    return p


def cli(*args: str) -> int:
    from fp8track.cli import main

    return main(["sweep", *args, "--no-progress"])


def runs(out: Path, name: str, role: str = "trial"):
    from mlflow.tracking import MlflowClient

    from fp8track.sweep.mlflow_runs import find_parent

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    exp_id, parent = find_parent(client, name)
    found = client.search_runs(
        [exp_id], filter_string=f"tags.mlflow.parentRunId = '{parent}' and tags.`fp8track.role` = '{role}'"
    )
    return client, exp_id, parent, sorted(found, key=lambda r: int(r.data.tags.get("fp8track.trial", -1)))


def trials_and_recommendation(out: Path, name: str) -> tuple[list[tuple[str, str]], dict[str, str]]:
    client, _, parent, found = runs(out, name)
    tags = client.get_run(parent).data.tags
    return ([(r.data.params["recipe"], r.data.params["bf16_layers"]) for r in found],
            {k: v for k, v in tags.items() if k.startswith("fp8track.recommendation")})


def test_program_runs_as_subprocesses_reproducibly_and_reuses_results(tmp_path: Path) -> None:
    """Same YAML and --seed twice: the same trials and recommendation. The program (not the
    executor) wrote each child run's metric. A second sweep of the same program and parameters in
    the same store trains nothing: every trial and the control come from the cache.
    Long (about 50 s): two sweeps of three trials and two controls, a subprocess each, then a third."""
    params = dict(
        recipe=["current", "mxfp8", "delayed"],
        bf16_layers=["none", "first:1", "last:1", "first_last"],
        steps=3,
        seed=0,
    )
    path = sweep_yaml(tmp_path, "repro", method="random", **params)
    args = ["--trials", "3", "--seed", "5", "--finalists", "1", "--control-seeds", "2"]
    assert cli(str(path), "--out", str(tmp_path / "a"), *args) == 0
    assert cli(str(path), "--out", str(tmp_path / "b"), *args) == 0
    first = trials_and_recommendation(tmp_path / "a", "repro")
    assert first == trials_and_recommendation(tmp_path / "b", "repro")
    assert len(first[0]) == 3 and first[1]["fp8track.recommendation"]  # the reason, with or without a pick

    client, exp_id, parent, found = runs(tmp_path / "a", "repro")
    assert client.get_experiment(exp_id).tags["mlflow.experimentKind"] == "custom_model_development"
    for r in found:
        history = client.get_metric_history(r.info.run_id, "val/loss")
        assert [m.step for m in sorted(history, key=lambda m: m.step)] == [
            0,
            1,
            2,
        ]  # the program's three values
        assert str(QUAD) in r.data.tags["fp8track.command"] and r.info.status == "FINISHED"
        assert sorted(r.data.params) == [
            "bf16_layers",
            "recipe",
        ]  # only what varies: constants are the parent's
    controls = runs(tmp_path / "a", "repro", "control")[3]
    assert sorted(r.data.params["seed"] for r in controls) == ["0", "1"]
    logs = sorted((tmp_path / "a" / "logs").glob("*.log"))

    renamed = yaml.safe_load(path.read_text()) | {"name": "repro-again"}
    path.write_text(yaml.safe_dump(renamed, sort_keys=False))  # same parameter order: same draws
    assert cli(str(path), "--out", str(tmp_path / "a"), *args) == 0
    assert sorted((tmp_path / "a" / "logs").glob("*.log")) == logs  # no program ran
    again = runs(tmp_path / "a", "repro-again")[3]
    assert len(again) == 3 and all(r.data.tags.get("fp8track.reused_from") for r in again)
    assert trials_and_recommendation(tmp_path / "a", "repro-again") == first


def test_a_metric_the_program_never_logs_is_one_error_after_the_first_run(tmp_path: Path, capsys) -> None:
    path = sweep_yaml(
        tmp_path,
        "nometric",
        recipe=["current"],
        bf16_layers=["none", "last:1"],
        steps=2,
        metric="none",
        seed=0,
    )
    out = tmp_path / "out"
    assert cli(str(path), "--trials", "2", "--out", str(out)) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(err) == 1, err  # one line (Optuna may log its own note on the failed trial)
    assert err[0].startswith("fp8track sweep: error: ")
    assert "without logging the sweep's metric 'val/loss'" in err[0] and "train/loss" in err[0]
    assert len(list((out / "logs").glob("*.log"))) == 1  # the control, and nothing after it


def test_pruned_trial_stops_its_program_and_shows_as_pruned(tmp_path: Path) -> None:
    """Hyperband prunes the worse trial of a bracket while its program runs: the program ignores
    SIGTERM, so the executor SIGKILLs it; its run is KILLED, tagged PRUNED, named [pruned].
    Long (about 40 s): four programs logging 0.6 s apart, so that pruning meets them running."""
    pids = tmp_path / "pids"
    pids.mkdir()
    path = sweep_yaml(
        tmp_path,
        "prune",
        recipe=["current", "delayed"],
        bf16_layers=["none", "last:1"],
        steps=6,
        sleep=0.6,
        hang=True,
        pid_dir=str(pids),
        seed=0,
    )
    cfg = yaml.safe_load(path.read_text()) | {
        "early_terminate": {"type": "hyperband", "min_iter": 1, "eta": 2, "max_iter": 4}
    }
    path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out"
    assert cli(str(path), "--trials", "4", "--out", str(out), "--control-seeds", "1", "--finalists", "1",
               "--kill-grace", "0.5") == 0
    client, _, _, found = runs(out, "prune")
    pruned = [r for r in found if r.data.tags["fp8track.state"] == "PRUNED"]
    assert pruned, [r.data.tags["fp8track.state"] for r in found]
    for r in pruned:
        assert r.info.status == "KILLED" and r.info.run_name.endswith("[pruned]")
        # hyperband decides by value 4 (max_iter); SIGTERM is ignored, so at most one more value
        # is logged before the SIGKILL, never all six
        assert len(client.get_metric_history(r.info.run_id, "val/loss")) <= 5
        pid = int((pids / f"{r.info.run_id}.pid").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    png = client.download_artifacts(runs(out, "prune")[2], "pareto.png", str(tmp_path))
    assert Path(png).stat().st_size > 10_000


def two_workers(tmp_path: Path, name: str, storage: str | None) -> Path:
    """Two ``fp8track sweep`` processes on one study: every trial once, none failed."""
    path = sweep_yaml(
        tmp_path,
        name,
        recipe=["current", "mxfp8"],
        bf16_layers=["none", "last:1"],
        steps=3,
        sleep=0.3,
        seed=0,
    )
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "fp8track.cli",
        "sweep",
        str(path),
        "--trials",
        "4",
        "--out",
        str(out),
        "--no-progress",
        "--finalists",
        "1",
        "--heartbeat",
        "2",
        "--grace",
        "60",
    ] + (["--storage", storage] if storage else [])
    # MLflow's SQLite store is created once before the workers start: two fresh processes creating
    # its schema at the same moment can fail one of them (MLflow's own migration race, seen once on
    # CI; open in the closing note). The study's storage race is what this test is about.
    out.mkdir(parents=True, exist_ok=True)
    from mlflow.tracking import MlflowClient

    MlflowClient(f"sqlite:///{out / 'mlflow.db'}").search_experiments()
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)
    ]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    failed = [out[-4000:] for p, out in zip(procs, outputs, strict=True) if p.returncode != 0]
    assert not failed, "\n---\n".join(failed)
    # one worker (the last trial's) reran the finalists and wrote the summary; the other read it or
    # said where it will be
    assert sum('"recommendation": {' in out for out in outputs) == 1, outputs
    import optuna

    study = optuna.load_study(study_name=name, storage=storage or f"sqlite:///{out / 'optuna.db'}")
    states = [t.state.name for t in study.get_trials() if not t.user_attrs.get("surplus")]
    assert states.count("COMPLETE") == 4 and "FAIL" not in states, states
    done = [tuple(sorted(t.params.items())) for t in study.get_trials() if t.state.name == "COMPLETE"]
    assert len(set(done)) == 4  # every grid point once
    workers = {t.user_attrs["worker"] for t in study.get_trials() if t.state.name == "COMPLETE"}
    assert len(workers) == 2, workers  # both took part
    found = runs(out, name)[3]
    assert sorted(r.data.tags["fp8track.trial"] for r in found) == sorted(
        str(t.number) for t in study.get_trials() if t.state.name == "COMPLETE"
    )
    return out


@pytest.mark.slow
def test_two_workers_on_one_sqlite_study(tmp_path: Path) -> None:
    """Long (about 40 s): two sweep processes and their trial programs racing on one study: the claim."""
    two_workers(tmp_path, "sqlite2", None)


@pytest.mark.slow
def test_users_llama_lightning_script_is_swept(tmp_path: Path) -> None:
    """Acceptance: a script outside the package (HF Llama from a config, Lightning, FP8Monitor)
    leaves a parent and one child run per trial written by that program, auto:1 resolved from the
    sweep's own ranking, and a recommendation naming its BF16 layers.
    Long (about 70 s): five Lightning programs as subprocesses (three trials, the control, a rerun),
    each importing Lightning and transformers."""
    path = sweep_yaml(
        tmp_path,
        "llama",
        program=LLAMA,
        recipe=["current"],
        bf16_layers=["none", "auto:1", "last:1"],
        steps=8,
        val_every=4,
        seed=0,
    )
    out = tmp_path / "out"
    # One control seed: the finalists' reruns on more seeds are the quadratic tests' (two Lightning
    # runs fewer here, a third of this test's time).
    assert cli(str(path), "--trials", "3", "--out", str(out), "--finalists", "1", "--control-seeds", "1") == 0
    client, _, parent, found = runs(out, "llama")
    assert len(found) == 3 and {r.data.params["bf16_layers"] for r in found} == {"none", "auto:1", "last:1"}
    for r in found:
        if r.data.tags.get("fp8track.reused_from"):
            continue
        keys = set(r.data.metrics)
        assert "val/loss" in keys and "train/loss" in keys  # the program's own MLFlowLogger
        assert any(k.startswith("fp8/") for k in keys)  # its FP8Monitor, through the same run
    by_spec = {r.data.params["bf16_layers"]: r for r in found}
    auto = by_spec["auto:1"].data
    assert auto.metrics["n_bf16_layers"] == 1 and auto.tags["fp8track.bf16_layer_names"] not in ("", "none")
    last = by_spec["last:1"].data
    # the last decoder layer: 7 linears (q, k, v, o, gate, up, down) out of 15 with the head
    assert last.metrics["n_bf16_layers"] == 7 and 0.4 < last.metrics["fp8_flop_share"] < 0.6
    tags = client.get_run(parent).data.tags
    assert tags["fp8track.recommendation.bf16_layers"] in by_spec
    names = tags["fp8track.recommendation.bf16_layer_names"]
    rec_run = by_spec[tags["fp8track.recommendation.bf16_layers"]].data
    assert names == rec_run.tags["fp8track.bf16_layer_names"]
    assert tags["fp8track.recommendation.apply_fp8"].startswith('apply_fp8(model, "current", bf16_layers=')


# --- PostgreSQL -------------------------------------------------------------------------------------


def _missing(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI must have it (make system-deps installs it as root)")
    pytest.skip(reason)


def _pg_bin(name: str) -> str | None:
    found = shutil.which(name) or sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found if isinstance(found, str) else (found[-1] if found else None)


@pytest.fixture
def postgres() -> Iterator[str]:
    """A PostgreSQL server on a free port of 127.0.0.1; yields its SQLAlchemy URL."""
    pytest.importorskip("psycopg2", reason="psycopg2-binary (fp8track[sweep]) is needed for PostgreSQL")
    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    if not (initdb and pg_ctl):
        _missing("PostgreSQL is not installed (apt-get install -y postgresql)")
    # PostgreSQL refuses to run as root: as root, run it as the package's postgres user.
    as_user: list[str] = []
    data = Path(tempfile.mkdtemp(prefix="fp8track-pg-"))
    if os.geteuid() == 0:
        try:
            import pwd

            pw = pwd.getpwnam("postgres")
        except KeyError:
            _missing("running as root but there is no postgres user to run PostgreSQL as")
        os.chown(data, pw.pw_uid, pw.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    db = data / "db"
    subprocess.run(
        [*as_user, initdb, "-D", str(db), "-U", "postgres", "--auth=trust", "-E", "UTF8"],
        check=True,
        capture_output=True,
    )
    opts = f"-p {port} -k {data} -c listen_addresses=127.0.0.1 -c max_connections=50"
    subprocess.run(
        [*as_user, pg_ctl, "-D", str(db), "-o", opts, "-l", str(data / "log"), "-w", "-t", "60", "start"],
        check=True,
        capture_output=True,
    )
    pid = int((db / "postmaster.pid").read_text().split()[0])
    try:
        yield f"postgresql+psycopg2://postgres@127.0.0.1:{port}/postgres"
    finally:
        os.kill(pid, signal.SIGINT)  # "fast" shutdown of the server we started, by its pid
        for _ in range(300):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        shutil.rmtree(data, ignore_errors=True)


@pytest.mark.slow
def test_two_workers_on_postgresql(tmp_path: Path, postgres: str) -> None:
    """Long (about 35 s): a PostgreSQL server and two sweep processes racing on its study: the claim."""
    two_workers(tmp_path, "pg2", postgres)
