"""What-if NVFP4 and column-wise rows reach every store: a BF16 control with ``whatif=["nvfp4"]``
and an MXFP8 run (column-wise copies) recorded at once into a run directory, MLflow on SQLite and
an offline W&B run, read back from each (the trackers' tensor tables), and shown in report.html."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("mlflow")
pytest.importorskip("wandb")

from fp8track import Monitor, apply_fp8  # noqa: E402
from fp8track.analysis.baseline import load_run  # noqa: E402
from fp8track.monitoring import naming  # noqa: E402
from fp8track.monitoring.monitor import data_fingerprint  # noqa: E402
from fp8track.report.run import diagnose_runs  # noqa: E402
from fp8track.trackers.mlflow import MLflowTracker  # noqa: E402
from fp8track.trackers.wandb import WandbTracker, find_wandb_run  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 24


def _train(tmp_path, name: str, recipe: str, whatif: tuple[str, ...], uri: str) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    report = apply_fp8(model, recipe, backend="emulated")
    wandb_dir = tmp_path / f"wandb_{name}"
    wandb_dir.mkdir()
    ml = MLflowTracker(tracking_uri=uri, run_name=name)
    wb = WandbTracker.create(project="fp8track-nvfp4", name=name, dir=str(wandb_dir), mode="offline")
    mon = Monitor(model, {"every_n_steps": 4, "whatif": whatif}, log_dir=tmp_path / "runs",
                  trackers=[ml, wb], apply_report=report)
    mon.record_data(data_fingerprint(seed=1, order=torch.arange(STEPS)))
    torch.manual_seed(5)
    target = nn.Linear(32, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(STEPS):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step))
        loss = (model(x) - target(x).detach()).pow(2).mean()
        loss.backward()
        opt.step()
        mon.step(loss=loss)
        opt.zero_grad()
    mon.close()
    return {"dir": str(mon.run_dir), "mlflow": f"mlflow:{ml.run_id}", "wandb": str(find_wandb_run(wandb_dir))}


def _variant_rows(run) -> dict[tuple[int, str, str, str], dict]:
    return {(int(r.step), r.layer, r.tensor, r.variant): r.stats for r in run.tensor_rows}


def _wandb_table_rows(wandb_file: str) -> dict[tuple[int, str, str, str], dict]:
    """The W&B tensor table as logged (the union of its incremental files), keyed like the records."""
    out = {}
    for f in sorted((Path(wandb_file).parent / "files" / "media" / "table").glob(
            f"{naming.TABLE_TENSOR_STATS}_*.table.json")):
        table = json.loads(f.read_text())
        for row in table["data"]:
            d = dict(zip(table["columns"], row, strict=True))
            out[(int(d["step"]), d["layer"], d["tensor"], d["variant"])] = d
    return out


def test_whatif_nvfp4_and_columnwise_rows_in_wandb_mlflow_and_report(tmp_path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    refs = {
        "control": _train(tmp_path, "control", "bf16", ("nvfp4",), uri),
        "fp8": _train(tmp_path, "fp8", "mxfp8", (), uri),
    }
    want = {"control": {"shadow", "nvfp4", "nvfp4_columnwise"}, "fp8": {"actual", "actual_columnwise"}}
    for run, ref in refs.items():
        local = _variant_rows(load_run(ref["dir"]))
        assert {k[3] for k in local} == want[run]
        for src in ("mlflow", "wandb"):
            got = (
                _variant_rows(load_run(ref[src], tracking_uri=uri))
                if src == "mlflow"
                else _wandb_table_rows(ref[src])
            )
            assert set(got) == set(local), (run, src)
            for k in local:
                for stat in ("underflow_pct", "mse", "sqnr_db", "overflow_pct"):
                    assert got[k][stat] == pytest.approx(local[k][stat], rel=1e-5, abs=1e-12), (
                        run,
                        src,
                        k,
                        stat,
                    )
    diagnose_runs(refs["fp8"]["dir"], refs["control"]["dir"], tmp_path / "diag")
    page = (tmp_path / "diag" / "report.html").read_text()
    assert 'id="variants"' in page
    for v in ("nvfp4", "nvfp4_columnwise", "actual_columnwise"):
        assert f"<td>{v}</td>" in page
