"""The README's plain-loop sweep, run as written: its ``my_train.py`` and YAML blocks copied out of
README.md into a folder and ``fp8track sweep my_sweep.yaml --trials 4`` run there; and the same
script with its loss kept out of MLflow (``Monitor(trackers=[])``), which must stop the sweep at the
first trial in one line naming the fix, the control left out of the cache."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("optuna")
pytest.importorskip("mlflow")

pytestmark = pytest.mark.slow
README = Path(__file__).resolve().parents[2] / "README.md"
ANCHOR = "A plain PyTorch loop sweeps too"


def readme_blocks() -> tuple[str, str]:
    """The first ``python`` and ``yaml`` blocks after :data:`ANCHOR`."""
    text = README.read_text().split(ANCHOR, 1)[1]
    python = re.search(r"```python\n(.*?)```", text, re.S)
    yaml_block = re.search(r"```yaml\n(.*?)```", text, re.S)
    assert python and yaml_block
    return python.group(1), yaml_block.group(1)


def _sweep(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FP8TRACK_STATS_KERNEL": "eager", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "fp8track.cli", "sweep", "my_sweep.yaml", *args, "--no-progress"]
    return subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=900)


def test_the_readme_plain_loop_sweep_runs_as_written(tmp_path: Path) -> None:
    """Long (about 2 min here): eight runs of the README's script (two control seeds, four
    trials, two finalist reruns), each a Python process importing torch and MLflow."""
    program, sweep = readme_blocks()
    (tmp_path / "my_train.py").write_text(program)
    (tmp_path / "my_sweep.yaml").write_text(sweep)
    done = _sweep(tmp_path, "--trials", "4")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Recommendation: recipe " in done.stdout or "No recommendation" in done.stdout, done.stdout
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'fp8track-sweep' / 'my-plain-sweep' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("my-plain-sweep")
    children = client.search_runs([exp.experiment_id], "tags.`fp8track.role` = 'trial'")
    assert len(children) == 4
    assert len({(r.data.params["recipe"], r.data.params["bf16_layers"]) for r in children}) == 4
    for r in children:  # the plain Monitor logged into the trial's run by itself
        assert "fp8/loss" in r.data.metrics and "gap_vs_bf16" in r.data.metrics
        assert "fp8/loss_gap_vs_baseline" in r.data.metrics  # the control served as its baseline


def test_a_control_whose_loss_never_reached_mlflow_stops_the_sweep_in_one_line(tmp_path: Path) -> None:
    program, sweep = readme_blocks()
    program = program.replace("apply_report=report)", "apply_report=report, trackers=[])")
    assert "trackers=[]" in program
    (tmp_path / "my_train.py").write_text(program)
    (tmp_path / "my_sweep.yaml").write_text(sweep)
    done = _sweep(tmp_path, "--trials", "4")
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [x for x in done.stderr.splitlines() if "error" in x.lower() or "Traceback" in x]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "refused the sweep's BF16 control mlflow:" in lines[0] and "none of the loss metrics" in lines[0]
    assert "fix: " in lines[0] and "trackers='auto'" in lines[0]
    out = tmp_path / "fp8track-sweep" / "my-plain-sweep"
    assert not list((out / "cache").glob("run-*.json"))  # the control is trained again next time
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    statuses = [r.info.status for r in client.search_runs([client.get_experiment_by_name("my-plain-sweep")
                                                           .experiment_id])]
    assert "RUNNING" not in statuses and "FAILED" in statuses, statuses
