"""`fp8track diagnose` end to end on synthetic run directories and an MLflow run: files, exit codes,
the report rendered in headless Chromium with its figures and findings."""

import json
import subprocess
import sys
from html.parser import HTMLParser

import numpy as np

from fp8track.analysis.synthetic_loss import plant_divergence  # noqa: E402

from helpers.synthetic_runs import PLANTED, layer_rows, synthetic_pair


def _cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "fp8track.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
    )


class _Imgs(HTMLParser):
    def __init__(self):
        super().__init__()
        self.imgs, self.kinds = [], []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img":
            self.imgs.append(a.get("src", ""))
        if a.get("data-kind"):
            self.kinds.append(a["data-kind"])


def _planted(tmp_path):
    # the planted layer from step 150 and the loss rising from 160: a mid-training gap naming it, and
    # the layer outlier (statistics nominate, the loss decides)
    run, ctl = synthetic_pair(
        tmp_path,
        fp8_rows=lambda rng: layer_rows(rng, planted_from=150),
        fp8_loss=lambda c, rng: plant_divergence(c * (1 + rng.normal(0, 0.002, len(c))), 160, 0.004),
    )
    return tmp_path / "fp8", tmp_path / "control"


def test_diagnose_writes_json_and_a_self_contained_report(tmp_path):
    fp8, ctl = _planted(tmp_path)
    proc = _cli("diagnose", fp8, "--baseline", ctl, "--out", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert "layer_outlier" in proc.stdout and PLANTED in proc.stdout and "report.html" in proc.stdout
    d = json.loads((tmp_path / "out" / "diagnosis.json").read_text())
    assert [f["kind"] for f in d["findings"]] == ["mid_training_gap", "layer_outlier"]
    assert d["findings"][0]["layers"][0] == PLANTED and d["layer_ranking"][0]["layer"] == PLANTED
    assert len(d["layer_ranking"]) == 13 and all("score" in r and "stats" in r for r in d["layer_ranking"])
    html = (tmp_path / "out" / "report.html").read_text()
    p = _Imgs()
    p.feed(html)
    assert p.kinds == ["mid_training_gap", "layer_outlier"]
    assert len(p.imgs) == 7 and all(
        s.startswith("data:image/png;base64,") for s in p.imgs
    )  # loss, eval, ranking, 4 heatmaps
    assert "http" not in html.replace("http-equiv", "")  # nothing fetched from the network
    assert "no fixed universal threshold" in d["method"]


def test_unusable_input_exits_2_naming_it(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # "mlflow:abc" with no store configured
    fp8, ctl = _planted(tmp_path)
    proc = _cli("diagnose", tmp_path / "nope", "--baseline", ctl)
    assert proc.returncode == 2
    assert "nope" in proc.stderr and "does not exist" in proc.stderr and "Traceback" not in proc.stderr
    proc = _cli("diagnose", fp8, "--baseline", "mlflow:abc")
    assert proc.returncode == 2 and "needs a tracking URI" in proc.stderr
    # a sqlite store that does not exist is refused, not created empty by MLflow on the way
    missing = tmp_path / "typo.db"
    proc = _cli("diagnose", fp8, "--baseline", "mlflow:abc", "--tracking-uri", f"sqlite:///{missing}")
    assert proc.returncode == 2 and "no MLflow database there" in proc.stderr and not missing.exists()


def test_diagnose_reads_an_mlflow_run_and_logs_the_report_there(tmp_path):
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    fp8, ctl = _planted(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("x", artifact_location=(tmp_path / "art").as_uri())
    run_id = client.create_run(exp).info.run_id
    from fp8track.monitoring.records import RunReader

    metrics = []
    for rec in RunReader(fp8).metrics():
        metrics += [Metric(k, v, 0, rec.step) for k, v in rec.metrics.items()]
    for r in RunReader(fp8).tensor_stats():  # per-layer scalars, as the MLflow tracker logs them
        metrics += [Metric(f"fp8/{r.layer}/{r.tensor}/{s}", r.stats[s], 0, r.step)
                    for s in ("sqnr_db", "cos", "underflow_pct", "overflow_pct", "scale_drift_log2")]
    for i in range(0, len(metrics), 1000):
        client.log_batch(run_id, metrics=metrics[i:i + 1000])
    proc = _cli(
        "diagnose", f"mlflow:{run_id}", "--baseline", ctl, "--out", tmp_path / "out", "--tracking-uri", uri
    )
    assert proc.returncode == 0, proc.stderr
    d = json.loads((tmp_path / "out" / "diagnosis.json").read_text())
    assert d["findings"][0]["kind"] == "mid_training_gap" and d["layer_ranking"][0]["layer"] == PLANTED
    arts = {a.path for a in client.list_artifacts(run_id, "fp8track-diagnosis")}
    assert arts == {"fp8track-diagnosis/report.html", "fp8track-diagnosis/diagnosis.json"}


def test_report_renders_in_headless_chromium(tmp_path, chromium):
    fp8, ctl = _planted(tmp_path)
    assert _cli("diagnose", fp8, "--baseline", ctl, "--out", tmp_path / "out").returncode == 0
    url = (tmp_path / "out" / "report.html").as_uri()
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--user-data-dir={tmp_path / 'prof'}",
    ]
    dom = subprocess.run([chromium, *flags, "--dump-dom", url], capture_output=True, text=True, timeout=180)
    assert dom.returncode == 0, dom.stderr[-2000:]
    p = _Imgs()
    p.feed(dom.stdout)
    assert p.kinds == ["mid_training_gap", "layer_outlier"] and len(p.imgs) == 7
    assert 'id="fig-loss"' in dom.stdout and 'id="layer-ranking"' in dom.stdout
    shot = tmp_path / "shot.png"
    proc = subprocess.run([chromium, *flags, f"--screenshot={shot}", "--window-size=1200,2400", url],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and shot.exists(), proc.stderr[-2000:]
    from PIL import Image

    img = np.asarray(Image.open(shot).convert("L"), dtype=np.float64)
    assert img.shape == (2400, 1200)
    assert img.std() > 20  # not a blank page: text and figures
    assert (img < 100).mean() > 0.01  # dark pixels: figures and text were painted


def test_check_inference_cli_on_an_example_checkpoint(tmp_path):
    import torch

    from fp8track.examples.gpt_lightning import build_example
    from fp8track.inference import save_checkpoint

    build = {
        "recipe": "delayed:hybrid:h16:max",
        "n_layer": 1,
        "n_embd": 32,
        "block_size": 32,
        "max_bytes": 20000,
    }
    module, data, _ = build_example(**build)
    data.setup()
    x, y = next(iter(data.train_dataloader()))
    module.train()
    for _ in range(3):  # fill the amax histories
        module.model.loss(x, y).backward()
    path = save_checkpoint(module, tmp_path / "m.ckpt", example="gpt", **build)
    proc = _cli("check-inference", path, "--batches", "2", "--out", tmp_path / "inf")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "restores weights and scaling state exactly" in proc.stdout
    res = json.loads((tmp_path / "inf" / "inference.json").read_text())
    assert set(res["metrics"]) == {"fp8_trained_scales", "fp8_fresh_scales", "bf16"}
    assert res["checkpoint_restored_exactly"] is True and res["problems"] == []
    torch.save({"state_dict": {}}, tmp_path / "plain.pt")
    bad = _cli("check-inference", tmp_path / "plain.pt")
    assert (
        bad.returncode == 2 and "not an fp8track checkpoint" in bad.stderr and "Traceback" not in bad.stderr
    )
