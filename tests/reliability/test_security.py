"""Guarantee 7: safe loaders only, and no credential in anything fp8track writes.

* The package's source uses YAML only through safe loaders, never pickle, and ``torch.load``
  only with ``weights_only=True`` (checked on the syntax tree of every module).
* Credentials planted in the environment (``WANDB_API_KEY``, ``MLFLOW_TRACKING_PASSWORD``) and in
  URIs (``https://user:pass@host``) appear in no params, tags, config, record, missed-step file,
  warning or log line: every file under the run's folders and everything printed is searched.
"""

from __future__ import annotations

import ast
import logging
import warnings
from pathlib import Path

import pytest
import torch

import fp8track
from fp8track import MonitorConfig
from fp8track.frontend import Monitor
from fp8track.monitoring.records import EventRecord, RunMeta, redact

PACKAGE = Path(fp8track.__file__).parent


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node, ast.unparse(node.func)


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_unsafe_loader_in_the_package(path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            )
            assert not any(
                n.split(".")[0] in ("pickle", "cPickle", "dill", "shelve", "marshal") for n in names
            ), path
    for call, func in _calls(tree):
        if func in ("yaml.load", "yaml.load_all", "yaml.unsafe_load", "yaml.full_load"):
            loader = {k.arg: ast.unparse(k.value) for k in call.keywords}.get("Loader", "")
            assert "SafeLoader" in loader, f"{path}:{call.lineno}: {ast.unparse(call)}"
        if func == "torch.load":
            kw = {k.arg: ast.unparse(k.value) for k in call.keywords}
            assert kw.get("weights_only") == "True", f"{path}:{call.lineno}: {ast.unparse(call)}"


SECRETS = {
    "WANDB_API_KEY": "wandbkey0123456789abcdef0123456789abcdef",
    "MLFLOW_TRACKING_PASSWORD": "mlflow-password-8d3f",
}
URI_PASSWORD = "uri-password-5c1e"


def test_planted_credentials_never_appear_in_any_output(tmp_path, monkeypatch, capsys, caplog):
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    from fp8track.trackers.mlflow import MLflowTracker
    from fp8track.trackers.retry import Backoff
    from fp8track.trackers.wandb import WandbTracker

    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    caplog.set_level(logging.DEBUG)
    uri = f"https://alice:{URI_PASSWORD}@127.0.0.1:9/mlflow"  # port 9 (discard): refused at once
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    good = MLflowTracker(
        tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", artifact_location=(tmp_path / "art").as_uri()
    )
    unreachable = MLflowTracker(tracking_uri=uri, name="mlflow-remote", retry=Backoff(for_s=0))
    wb = WandbTracker.create(project="p", dir=str(tmp_path), mode="offline")
    meta = RunMeta(name="secret-test", config={"tracking_uri": uri, "token": SECRETS["WANDB_API_KEY"]})
    monitor = Monitor(
        model,
        MonitorConfig(every_n_steps=1),
        log_dir=tmp_path / "runs",
        trackers=[good, unreachable, wb],
        meta=meta,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor.attach()
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            monitor.step(loss=1.0)
        # an analyzer-style event whose payload quotes the URI
        monitor._emit(3, {}, [], [EventRecord("finding", 3, {"title": f"cannot reach {uri}", "layer": "0"})])
        monitor.close()
    printed = capsys.readouterr()
    texts = [str(w.message) for w in caught] + [printed.out, printed.err, caplog.text]
    assert any("mlflow-remote" in t for t in texts)  # the failure was reported...
    for path in tmp_path.rglob("*"):
        if path.is_file():
            texts.append(path.read_bytes().decode("utf-8", errors="replace"))
    assert len(texts) > 10
    needles = [*SECRETS.values(), URI_PASSWORD]
    for text in texts:
        for needle in needles:
            assert needle not in text, (
                f"credential {needle!r} leaked: "
                f"...{text[max(text.find(needle) - 200, 0) : text.find(needle) + 50]}"
            )
    # ...with the credentials replaced, not the whole message dropped
    assert any("https://***@127.0.0.1:9" in t for t in texts)


def test_redact_forms():
    assert redact("sqlite:///x.db http://h:5000") == "sqlite:///x.db http://h:5000"
    assert redact("postgresql://u:p@db/x and s3://k@bucket") == "postgresql://***@db/x and s3://***@bucket"
