"""A training script nobody here wrote the loop of (tests/third_party/train_gpt.py: nanoGPT's shape,
``--key=value`` flags, gradient accumulation, ``torchrun`` DDP), with fp8track added by the lines the
README shows: statistics for every linear, one record per optimizer step (not per micro-step), the
loss in the monitor and in the MLflow run the script opened itself, rank 0 alone writing under
torchrun, ``fp8track diagnose`` against its BF16 control, and ``fp8track sweep`` over its
``--key=value`` flags (recipes x BF16 layers) ending with a recommendation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fp8track.monitoring.naming import LOSS_METRIC
from fp8track.monitoring.records import RunReader

from helpers.subprocesses import run_gloo_program

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parents[1] / "third_party" / "train_gpt.py"
LINEARS = {f"h.{i}.{m}" for i in range(2) for m in ("attn.c_attn", "attn.c_proj", "mlp.0", "mlp.2")} | {
    "lm_head"
}
ITERS = 12


def _run(tmp_path: Path, *flags: str, torchrun: int = 0) -> Path:
    cmd = [sys.executable, str(SCRIPT), f"--max_iters={ITERS}", f"--out_dir={tmp_path / 'out'}", *flags]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}",
               *cmd[1:]]
    tmp_path.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = run_gloo_program(cmd, tmp_path / "out", cwd=tmp_path, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = sorted((tmp_path / "out" / "fp8track").iterdir())
    assert len(runs) == 1, runs  # one run directory: under torchrun rank 0 alone writes
    return runs[0]


def test_plain_script_records_every_linear_per_optimizer_step_and_logs_into_its_mlflow_run(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = _run(tmp_path, "--recipe=current", f"--mlflow_uri={uri}", "--every_n_steps=4")
    reader = RunReader(run)
    rows = list(reader.tensor_stats())
    assert {r.layer for r in rows} == LINEARS
    assert sorted({r.step for r in rows}) == [0, 4, 8]
    assert all(
        {(r.layer, t) for t in ("activation", "weight", "gradient")} <= {(x.layer, x.tensor) for x in rows}
        for r in rows
    )
    losses = {m.step: m.metrics[LOSS_METRIC] for m in reader.metrics() if LOSS_METRIC in m.metrics}
    assert sorted(losses) == list(range(ITERS))  # optimizer steps, not the 2 micro-steps of each
    import mlflow

    client = mlflow.MlflowClient(uri)
    (mlrun,) = client.search_runs(client.get_experiment_by_name("Default").experiment_id)
    history = {m.step: m.value for m in client.get_metric_history(mlrun.info.run_id, LOSS_METRIC)}
    assert history.keys() == losses.keys()
    assert all(abs(history[s] - losses[s]) < 1e-6 for s in losses)
    assert "train/loss" in mlrun.data.metrics  # the script's own metrics beside fp8track's


def test_torchrun_two_ranks_one_run_directory(tmp_path):
    run = _run(tmp_path, "--recipe=delayed", "--every_n_steps=4", torchrun=2)
    losses = [m.step for m in RunReader(run).metrics() if LOSS_METRIC in m.metrics]
    assert losses == list(range(ITERS))
    assert {r.layer for r in RunReader(run).tensor_stats()} == LINEARS


def test_diagnose_against_the_scripts_own_control(tmp_path):
    control = _run(tmp_path / "c", "--recipe=bf16")
    fp8 = _run(tmp_path / "f", "--recipe=current", f"--control={control}")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fp8track.cli",
            "diagnose",
            str(fp8),
            "--control",
            str(control),
            "--out",
            str(tmp_path / "diag"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    diagnosis = json.loads((tmp_path / "diag" / "diagnosis.json").read_text())
    assert [f["kind"] for f in diagnosis["findings"]] == ["healthy"]


SWEEP_YAML = """\
name: gpt-flags
program: {program}
command:
  - ${{env}}
  - ${{interpreter}}
  - ${{program}}
  - ${{args}}
  - --mlflow_uri=${{envvar:MLFLOW_TRACKING_URI}}
method: grid
metric: {{name: val/loss, goal: minimize}}
parameters:
  recipe: {{values: [current, delayed]}}
  bf16_layers: {{values: [none, last:1]}}
  max_iters: {{value: 6}}
  eval_interval: {{value: 5}}
  eval_iters: {{value: 2}}
  every_n_steps: {{value: 3}}
  seed: {{value: 1337}}
"""


def test_sweep_over_the_scripts_flags_recommends(tmp_path):
    """``fp8track sweep`` runs the script as ``wandb agent`` would (``--key=value`` flags, its
    MLflow run opened by the script itself through ``MLFLOW_RUN_ID``, the tracking URI passed by
    ``${envvar:...}``): four trials (2 recipes x 2 fallback specs), one BF16 control, a
    recommendation naming a recipe and the ``apply_fp8`` line; the monitor's own tags give the
    BF16 layers although the script never calls ``trial_settings``.
    Long (about 1 min here): five runs of the script, each a process importing torch and MLflow."""
    (tmp_path / "sweep.yaml").write_text(SWEEP_YAML.format(program=SCRIPT))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FP8TRACK_STATS_KERNEL": "eager"}
    done = subprocess.run(
        [sys.executable, "-m", "fp8track.cli", "sweep", "sweep.yaml", "--trials", "4", "--control-seeds", "1",
         "--finalists", "1", "--no-progress"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Recommendation: recipe " in done.stdout, done.stdout
    assert "apply_fp8(model, " in done.stdout
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'fp8track-sweep' / 'gpt-flags' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("gpt-flags")
    trials = client.search_runs([exp.experiment_id], "tags.`fp8track.role` = 'trial'")
    assert sorted((r.data.params["recipe"], r.data.params["bf16_layers"]) for r in trials) == [
        ("current", "last:1"), ("current", "none"), ("delayed", "last:1"), ("delayed", "none")]
    for r in trials:
        assert r.info.run_name.startswith("trial-")  # the script's run_name does not stick
        assert LOSS_METRIC in r.data.metrics and "gap_vs_bf16" in r.data.metrics
        kept = r.data.tags["fp8.bf16_layers"]  # last:1 = the last block of the stack h.0, h.1
        block = ",".join(f"h.1.{m}" for m in ("attn.c_attn", "attn.c_proj", "mlp.0", "mlp.2"))
        assert kept == (block if r.data.params["bf16_layers"] == "last:1" else "none")
