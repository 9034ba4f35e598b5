"""The README's main job, end to end: `fp8track demo` on a short budget, with W&B offline."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from fp8track.analysis.baseline import read_wandb_history
from fp8track.analysis.ranking import MATERIAL_MARGINS
from fp8track.demo import PLANT_FRACTION, PLANT_LAYER
from fp8track.monitoring.naming import canonical_layer_name
from fp8track.monitoring.records import RunReader

from helpers.subprocesses import user_default_env

STEPS, EVERY = 30, 5


@pytest.mark.slow
def test_demo_trains_three_runs_diagnoses_and_keeps_wandb_runs_apart(tmp_path):
    """Long (about 45 s): `fp8track demo` as a user runs it, in a fresh process: three trainings, two
    diagnoses, MLflow and W&B offline."""
    out = tmp_path / "demo"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fp8track.cli",
            "demo",
            "--out",
            str(out),
            "--steps",
            str(STEPS),
            "--every-n-steps",
            str(EVERY),
            "--no-progress",
            "--wandb",
        ],
        capture_output=True,
        text=True,
        timeout=1200,
        env=user_default_env(),  # the statistics kernel a user gets (auto): compiled in this fresh process
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the console ends with the answers; the summary is a file, not a JSON dump on the console
    summary = json.loads((out / "demo.json").read_text())
    assert '"runs"' not in proc.stdout
    answers = proc.stdout[proc.stdout.index("== answers ==") :].strip().splitlines()[1:]
    assert [a.split(":")[0] for a in answers] == ["fp8-delayed", "fp8-planted"]
    assert "[fp8track] training [1/3] bf16-control" in proc.stdout
    control, fp8, planted = summary["runs"]
    assert (control["recipe"], fp8["recipe"], planted["name"]) == (
        "bf16",
        "delayed:hybrid:h16:max",
        "fp8-planted",
    )
    uri = f"sqlite:///{out / 'mlflow.db'}"
    # the printed command runs as printed (the venv's own mlflow: nobody activated it), and the
    # runs link opens the demo's experiment on its runs table (MLflow 3's route, not GenAI's overview)
    look = re.search(r"Look at it: +(.+)", proc.stdout).group(1).split()
    assert look[1:] == ["ui", "--backend-store-uri", uri], look
    assert Path(look[0]).is_file() and os.access(look[0], os.X_OK), look[0]
    assert subprocess.run([look[0], "ui", "--help"], capture_output=True, timeout=300).returncode == 0
    exp_id = MlflowClient(uri).get_experiment_by_name("fp8track-demo").experiment_id
    runs_url = re.search(r"then open the runs: +(\S+)", proc.stdout).group(1)
    assert runs_url == f"http://127.0.0.1:5000/#/experiments/{exp_id}/runs?workflowType=machine_learning"
    url = re.search(r"and compare them: +(\S+)", proc.stdout).group(1)
    assert all(r["mlflow_run_id"] in url for r in summary["runs"]) and "#/compare-runs?runs=" in url
    # the console carries fp8track's answers, not library chatter
    assert "Top-ranked layer:" in proc.stdout and "Report:" in proc.stdout
    for noise in ("GPU available", "Tip:", "litlogger", "alembic", "wandb: "):
        assert noise not in proc.stdout + proc.stderr, noise

    client = MlflowClient(uri)
    for run in summary["runs"]:
        reader = RunReader(run["run_dir"])
        assert sorted(reader.series("fp8/loss")) == list(range(STEPS))
        assert {r.step for r in reader.tensor_stats()} == set(range(0, STEPS, EVERY))
        evals = reader.series("fp8/eval/val_loss")  # validation recorded per evaluation
        assert sorted(evals) == [6, 12, 18, 24, 30]
        assert client.get_run(run["mlflow_run_id"]).data.tags["fp8track.run_id"] == reader.meta()["run_id"]
    for label, run in (("fp8", fp8), ("planted", planted)):
        d = json.loads((out / f"diagnosis-{label}" / "diagnosis.json").read_text())
        assert d["findings"] and len(d["layer_ranking"]) == 9  # the example GPT's 9 linear layers
        assert summary["findings"][label] == [f["kind"] for f in d["findings"]]
        arts = {a.path for a in client.list_artifacts(run["mlflow_run_id"], "fp8track-diagnosis")}
        assert arts == {"fp8track-diagnosis/report.html", "fp8track-diagnosis/diagnosis.json"}
    assert (out / "fp8.ckpt").is_file()

    # the planted problem is the answer: top finding and top-ranked layer are the planted layer, at
    # this short step count too, and the report's summary (and the heatmaps' marked rows, the top of
    # the same ranking) name it
    d = json.loads((out / "diagnosis-planted" / "diagnosis.json").read_text())
    planted_layer = d["layer_ranking"][0]["layer"]  # as recorded (canonical: the holder `model.` dropped)
    assert canonical_layer_name(planted_layer, holder="model") == PLANT_LAYER, d["layer_ranking"][:2]
    assert d["findings"][0]["layers"][0] == planted_layer, d["findings"][0]
    assert d["findings"][0]["kind"] in ("layer_outlier", "mid_training_gap"), d["findings"][0]
    assert d["layer_ranking"][0]["rank"] == 1
    assert not d["layer_ranking"][0]["tied"]
    assert d["layer_ranking"][0]["score"] > 3 * d["layer_ranking"][1]["score"]
    # its own onset: within one sampling interval of the plant (3 samples at least on each side of a split)
    assert d["layer_ranking"][0]["onset"] >= int(PLANT_FRACTION * STEPS) - EVERY
    html = (out / "diagnosis-planted" / "report.html").read_text()
    assert f"<tr><th>top-ranked layer</th><td>{planted_layer}</td></tr>" in html
    planted_console = proc.stdout[proc.stdout.index("== planted run"):]
    assert f"Top-ranked layer: {planted_layer}" in " ".join(planted_console.split())
    # the console's last word on the planted run names the planted layer, in its top finding too
    # and its verdict: an FP8 problem caused by the planted layer, the verdict first in the file
    assert next(iter(d)) == "verdict"
    assert d["verdict"]["verdict"] == "fp8_problem" and d["verdict"]["layers"][0] == planted_layer
    assert answers[1].startswith(f"fp8-planted: fp8_problem: {d['findings'][0]['kind']} (")
    assert PLANT_LAYER in answers[1]
    # the unplanted run: a layer called an outlier differs from the others by an amount that matters
    d_fp8 = json.loads((out / "diagnosis-fp8" / "diagnosis.json").read_text())
    margins = {r["layer"]: r["margin"] for r in d_fp8["layer_ranking"]}
    for f in d_fp8["findings"]:
        if f["kind"] == "layer_outlier":
            m = margins[f["layers"][0]]
            assert any(m.get(k, float("nan")) >= v for k, v in MATERIAL_MARGINS.items()), (f, m)

    # one W&B run per training run (a reused run would mix the three losses into one history)
    by_id: dict[str, list[Path]] = {}
    for f in sorted((out / "wandb").glob("offline-run-*/run-*.wandb")):
        by_id.setdefault(f.stem[len("run-"):], []).append(f)
    ids = [r["wandb_run_id"] for r in summary["runs"]]
    assert len(set(ids)) == 3 and set(ids) <= set(by_id)
    for run in summary["runs"]:
        rows = read_wandb_history(by_id[run["wandb_run_id"]][0])
        steps = sorted({int(r["trainer/global_step"]) for r in rows if "fp8/loss" in r})
        assert steps == list(range(STEPS))  # the loss of every optimizer step, not only the sampled ones
        ours = RunReader(run["run_dir"]).series("fp8/loss")
        assert all(
            r["fp8/loss"] == pytest.approx(ours[int(r["trainer/global_step"])])
            for r in rows
            if "fp8/loss" in r
        )
    # the report went into the FP8 runs' W&B runs as HTML (a resumed offline run with the same id)
    for run in (fp8, planted):
        rows = [r for f in by_id[run["wandb_run_id"]] for r in read_wandb_history(f)]
        # the history reader flattens nested values:
        # {"fp8track/report": {"_type": ...}} -> "fp8track/report._type"
        assert any(
            r.get("fp8track/report._type") == "html-file"
            or (
                isinstance(r.get("fp8track/report"), dict)
                and r["fp8track/report"].get("_type") == "html-file"
            )
            for r in rows
        ), rows[-1]


def test_a_second_demo_into_the_same_folder_leaves_one_run_per_name(tmp_path):
    """The demo deletes (MLflow's soft delete) its earlier runs of the same names in its store
    before training again; other runs of the experiment stay."""
    from fp8track.demo import DEMO_EXPERIMENT, retire_previous_runs

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    names = ["bf16-control", "fp8-delayed", "fp8-planted"]
    assert retire_previous_runs(uri, names) == 0  # no store yet: nothing created either
    assert not (tmp_path / "mlflow.db").exists()
    client = MlflowClient(uri)
    exp = client.create_experiment(DEMO_EXPERIMENT)
    for name in [*names, "mine"]:
        client.set_terminated(client.create_run(exp, run_name=name).info.run_id)
    assert retire_previous_runs(uri, names) == 3
    assert [r.info.run_name for r in client.search_runs([exp])] == ["mine"]
