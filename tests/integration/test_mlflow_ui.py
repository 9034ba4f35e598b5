"""The sweep and the monitor's params as MLflow's own UI shows them, rendered in headless Chromium.

A real ``mlflow server`` (SQLite store, free port on 127.0.0.1, stopped by its pid) holds a small
finished sweep of the model-free ``tests/sweep_programs/quadratic.py`` (hyperband prunes a trial)
and three runs whose params the monitor's ``MLflowTracker`` wrote (a BF16 control, a current and
a delayed run). Chromium renders (``--dump-dom`` with enough virtual time for the React app's
AJAX calls; virtual time does not advance while a fetch is pending) the links the sweep prints:
the experiment opens on its runs, the compare view's plot starts on ``bf16_layers``, ``recipe``
and ``fp8_flop_share``, its params are the sweep's two, a pruned trial shows as pruned; the
monitor's compare view has counts, not layer lists, and no amax history where none applies.
``pareto.png`` is shown as an image on the parent run's artifact page, and Chromium paints it pixel
for pixel.
Skips only when Chromium is missing and cannot be installed (``tests/conftest.py``)."""

from __future__ import annotations

import io
import re
import subprocess
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import yaml

pytest.importorskip("optuna")
pytest.importorskip("mlflow")
Image = pytest.importorskip("PIL.Image")

from helpers.servers import free_port, mlflow_server  # noqa: E402

pytestmark = pytest.mark.slow
QUAD = Path(__file__).resolve().parents[1] / "sweep_programs" / "quadratic.py"


class Page(HTMLParser):
    """The rendered page: its text, the rows of each table (cell texts) and the items selected in
    its pickers (the compare view's parallel-coordinates axes), in order."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.tables: list[list[list[str]]] = []
        self.selected: list[str] = []
        self.images: list[str] = []
        self._text: list[str] = []
        self._row: list[str] | None = None
        self._cell: list[str] | None = None
        self._in_selected = False
        self._skip = 0
        self.feed(html)
        self.text = " ".join(" ".join(self._text).split())

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag in ("script", "style"):
            self._skip += 1
        elif tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self._row = []
        elif tag in ("td", "th") and self._row is not None:
            self._cell = []
        elif tag == "span" and "selection-item-content" in (a.get("class") or ""):
            self._in_selected = True
            self.selected.append("")
        elif tag == "img" and a.get("src"):
            self.images.append(str(a["src"]))

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style"):
            self._skip -= 1
        elif tag in ("td", "th") and self._cell is not None and self._row is not None:
            self._row.append(" ".join(" ".join(self._cell).split()))
            self._cell = None
        elif tag == "tr" and self._row is not None:
            if self.tables:
                self.tables[-1].append(self._row)
            self._row = None
        elif tag == "span":
            self._in_selected = False

    def handle_data(self, data: str) -> None:
        if self._skip:
            return
        self._text.append(data)
        if self._cell is not None:
            self._cell.append(data)
        if self._in_selected:
            self.selected[-1] += data

    def table_with(self, key: str) -> dict[str, list[str]]:
        """The table holding a row whose first cell is ``key``: first cell -> the other cells."""
        for table in self.tables:
            rows = {r[0]: r[1:] for r in table if r}
            if key in rows:
                return rows
        raise AssertionError(f"no table row {key!r} in the rendered page: {self.text[:1500]}")


def chromium_run(chromium: str, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             f"--user-data-dir={tmp}", "--window-size=1600,1200"]  # a fresh profile: default workflow
    proc = subprocess.run([chromium, *flags, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def render(chromium: str, tmp_path: Path, url: str, marker: str) -> Page:
    """The DOM after the app has loaded its data; rendered again with more virtual time while
    ``marker`` (text the loaded page shows) is missing."""
    for budget in (15000, 40000):
        page = Page(chromium_run(chromium, tmp_path / f"prof{budget}", f"--virtual-time-budget={budget}",
                                 "--dump-dom", url).stdout)
        if marker in page.text:
            return page
    raise AssertionError(f"{url}: {marker!r} never rendered; the page said: {page.text[:1500]}")


def monitor_runs(uri: str) -> tuple[str, list[str]]:
    """Three runs whose params the monitor's MLflowTracker wrote from real apply_fp8 reports."""
    from mlflow.tracking import MlflowClient
    from torch import nn

    from fp8track.execution.apply import apply_fp8
    from fp8track.monitoring.monitor import run_meta_for
    from fp8track.trackers.mlflow import MLflowTracker

    ids = []
    for recipe, spec in (("bf16", "none"), ("current", "last:1"), ("delayed:hybrid:h16:max", "first:1")):
        model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])
        meta = run_meta_for(model, config={"monitor": {"every_n_steps": 1}},
                            report=apply_fp8(model, recipe, bf16_layers=spec, backend="emulated"))
        tracker = MLflowTracker(tracking_uri=uri, experiment_name="monitor-params", background=False,
                                heatmap=False, run_name=recipe.split(":")[0])
        tracker.start(meta)
        ids.append(tracker.run_id)
    return MlflowClient(uri).get_experiment_by_name("monitor-params").experiment_id, ids


def test_sweep_and_monitor_params_in_the_mlflow_ui(
    tmp_path: Path, chromium: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Long (about 50 s): a real mlflow server, a sweep's subprocesses and Chromium rendering the UI."""
    from mlflow.tracking import MlflowClient

    from fp8track.cli import main
    from fp8track.sweep.links import compare_url

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    body = {
        "name": "ui", "program": str(QUAD), "method": "grid",
        "metric": {"name": "val/loss", "goal": "minimize"},
        "parameters": {"recipe": {"values": ["current", "delayed"]},
                       "bf16_layers": {"values": ["none", "last:1"]},
                       "steps": {"value": 3}, "seed": {"value": 0}},
        # delayed (penalty 0.3) is worse at every value: hyperband prunes trial 2 (delayed, none) of
        # grid seed 0's order; the runner judges every value it reads, even after the program exited
        "early_terminate": {"type": "hyperband", "min_iter": 1, "eta": 2, "max_iter": 2},
    }  # fmt: skip
    path = tmp_path / "ui.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    with mlflow_server(tmp_path, free_port()) as uri:
        assert main(["sweep", str(path), "--trials", "3", "--out", str(tmp_path / "out"),
                     "--tracking-uri", uri, "--control-seeds", "1", "--finalists", "1",
                     "--kill-grace", "0.5", "--no-progress"]) == 0
        printed = capsys.readouterr().out
        runs_link = re.search(r"runs:\s+(\S+)", printed).group(1)
        compare_link = re.search(r"compare:\s+(\S+)", printed).group(1)
        client = MlflowClient(uri)
        exp = client.get_experiment_by_name("ui")
        trials = client.search_runs([exp.experiment_id], "tags.`fp8track.role` = 'trial'")
        pruned = {r.info.run_name for r in trials if r.data.tags["fp8track.state"] == "PRUNED"}
        assert pruned and all(r.info.status == "KILLED" for r in trials if r.info.run_name in pruned)

        # The experiment opens on its runs table, not on MLflow 3's GenAI overview.
        page = render(chromium, tmp_path, runs_link, "matching runs")
        assert "Run Name" in page.text and "ui" in page.text.split()
        assert "Token Usage" not in page.text and "Latency" not in page.text

        # The trials' compare view: the plot's axes start on the sweep's params and the FP8 FLOP
        # share; the params table holds exactly those two; pruned trials say so.
        page = render(chromium, tmp_path, compare_link, "Run Name:")
        assert page.selected[:3] == ["bf16_layers", "recipe", "fp8_flop_share"], page.selected
        params = page.table_with("recipe")
        assert {k for k in params if not k.endswith(":")} == {"bf16_layers", "recipe"}
        names = page.table_with("Run Name:")["Run Name:"]
        assert len(names) == len(trials) and {n for n in names if n.endswith("[pruned]")} == pruned
        states = page.table_with("fp8track.state")["fp8track.state"]
        assert states.count("PRUNED") == len(pruned) and states.count("COMPLETE") == len(trials) - len(pruned)

        # The monitor's own params: counts, not comma lists; amax history only on the delayed run.
        exp_id, ids = monitor_runs(uri)
        page = render(chromium, tmp_path, compare_url(uri, exp_id, ids), "Run Name:")
        params = page.table_with("fp8.recipe.name")
        assert params["fp8.recipe.name"] == ["bf16", "current", "delayed"]
        assert params["fp8.n_bf16_layers"] == ["6", "1", "1"]
        assert params["fp8.n_fp8_layers"] == ["0", "5", "5"]
        assert params["fp8.recipe.amax_history_len"][2] == "16"
        assert all(v in ("", "-") for v in params["fp8.recipe.amax_history_len"][:2])  # not logged: empty
        assert "fp8.bf16_layers" not in params and "fp8.fp8_layers" not in params
        assert not [k for k in params if k.startswith("fp8track.config")]
        assert max(len(v) for row in params.values() for v in row) <= 20  # short values only
        tags = page.table_with("fp8.fp8_layers")["fp8.fp8_layers"]  # the lists are tags
        assert tags[0] == "none" and tags[1] == "0,1,2,3,4"  # current with last:1 keeps layer 5

        # pareto.png: the parent run's artifact page shows it, and Chromium paints it pixel for pixel.
        parent = client.search_runs([exp.experiment_id], "tags.`fp8track.role` = 'parent'")[0].info.run_id
        artifact_page = f"{uri}/#/experiments/{exp.experiment_id}/runs/{parent}/artifacts/pareto.png"
        page = render(chromium, tmp_path, artifact_page, "pareto.png")
        # the UI fetches the artifact and shows it as an image from a blob: URL
        assert any(src.startswith(f"blob:{uri}/") for src in page.images), page.images
        png_url = f"{uri}/get-artifact?path=pareto.png&run_uuid={parent}"
        with urllib.request.urlopen(png_url, timeout=30) as r:
            png = Image.open(io.BytesIO(r.read())).convert("RGB")
        shot = tmp_path / "pareto_shot.png"
        html = tmp_path / "pareto.html"
        html.write_text('<html><body style="margin:0;background:#000">'
                        f'<img style="display:block" src="{png_url}"></body></html>')
        chromium_run(chromium, tmp_path / "prof-png", f"--window-size={png.width},{png.height}",
                     "--hide-scrollbars", "--virtual-time-budget=5000", f"--screenshot={shot}", html.as_uri())
        painted = np.asarray(Image.open(shot).convert("RGB"), dtype=np.int16)[: png.height, : png.width]
        want = np.asarray(png, dtype=np.int16)
        assert painted.shape == want.shape
        assert np.abs(painted - want).max() <= 8  # the whole figure was painted (no black left)
        assert (want.mean(axis=2) < 100).mean() > 0.005  # labels, ticks, points: dark pixels on white
