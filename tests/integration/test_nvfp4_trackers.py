"""What-if NVFP4 and column-wise rows reach every store: a BF16 control with ``whatif=["nvfp4"]``
and an MXFP8 run (column-wise copies) recorded at once into a run directory, MLflow on SQLite and
an offline W&B run, read back from each (the trackers' tensor tables), and shown in report.html."""

from __future__ import annotations

import json
import math
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


def _train(tmp_path, name: str, recipe: str, whatif: tuple[str, ...], uri: str, experiment: str) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    report = apply_fp8(model, recipe, backend="emulated")
    wandb_dir = tmp_path / f"wandb_{name}"
    wandb_dir.mkdir()
    ml = MLflowTracker(tracking_uri=uri, experiment_name=experiment, run_name=name)
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


def test_whatif_nvfp4_and_columnwise_rows_in_wandb_mlflow_and_report(tmp_path, mlflow_store) -> None:
    uri, exp = mlflow_store.uri, mlflow_store.experiment()
    refs = {
        "control": _train(tmp_path, "control", "bf16", ("nvfp4",), uri, exp),
        "fp8": _train(tmp_path, "fp8", "mxfp8", (), uri, exp),
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


def _ref_block_range(t: torch.Tensor, size: int, tile: bool) -> float:
    """max_blockwise_dynamic_range by loops over the blocks of a 2-D tensor whose sides are whole
    blocks (TE's definition: log2(amax / nonzero amin) per block, 0 for an all-zero block)."""
    rows = size if tile else 1
    best = 0.0
    for i in range(0, t.shape[0], rows):
        for j in range(0, t.shape[1], size):
            nz = [abs(v) for v in t[i : i + rows, j : j + size].flatten().tolist() if v != 0]
            if nz:
                best = max(best, math.log2(max(nz)) - math.log2(min(nz)))
    return best


def _range_layout(variant: str, tensor: str) -> tuple[int, bool]:
    base = variant.removesuffix("_columnwise").replace("actual", "mxfp8")
    return {"mxfp8": (32, False), "block": (128, tensor == "weight"), "nvfp4": (16, tensor == "weight")}[base]


def test_max_blockwise_dynamic_range_end_to_end_in_records_mlflow_and_wandb(tmp_path, mlflow_store) -> None:
    """An MXFP8 layer with what-if nvfp4 / block / current, fed tensors with planted block ranges
    (two micro-batches: the step's value is the larger), dY set by the loss: every block row
    carries TE's max_blockwise_dynamic_range, equal to a loop over the blocks here, in the run
    directory, the MLflow table and the W&B table; per-tensor rows carry none."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32, bias=False))
    with torch.no_grad():
        model[0].weight.fill_(0.5)
        model[0].weight[3, 6] = 2.0**-9  # row 3 and column 6: 0.5 / 2^-9 -> 8 binades
    report = apply_fp8(model, "mxfp8", backend="emulated")
    uri = mlflow_store.uri
    (tmp_path / "wandb").mkdir()
    ml = MLflowTracker(tracking_uri=uri, experiment_name=mlflow_store.experiment(), run_name="range")
    wb = WandbTracker.create(project="fp8track-range", name="range", dir=str(tmp_path / "wandb"),
                             mode="offline")
    mon = Monitor(model, {"every_n_steps": 1, "whatif": ("nvfp4", "block", "current")},
                  log_dir=tmp_path / "runs", trackers=[ml, wb], apply_report=report)
    x1 = torch.ones(32, 32)
    x1[0, 0], x1[0, 1] = 8.0, 0.125  # row 0: 6 binades; columns 0 and 1: 3
    x2 = torch.ones(32, 32)
    x2[5, 9] = 0.5  # 1 binade either way: the first micro-batch's values stand
    g = torch.ones(32, 32)
    g[0, 0], g[1, 0] = 4.0, 0.25  # dY rows: 2 binades; column 0: 4
    mon.attach()
    mon.begin_step(0)
    for x in (x1, x2):
        (model(x) * g).sum().backward()  # dY = g exactly
    mon.step(loss=torch.tensor(1.0))
    mon.close()

    local = _variant_rows(load_run(mon.run_dir))
    acts = {"activation": (x1, x2), "weight": (model[0].weight.detach(),), "gradient": (g, g)}
    checked = 0
    for (_, _, tensor, variant), stats in local.items():
        if variant == "current":
            assert "max_blockwise_dynamic_range" not in stats
            continue
        size, tile = _range_layout(variant, tensor)
        orients = [False, True] if tensor in ("activation", "weight") else [False]  # TE's rule
        if variant.endswith("_columnwise"):
            orients = [True]
        want = max(_ref_block_range(t.t() if col else t, size, tile) for t in acts[tensor] for col in orients)
        assert stats["max_blockwise_dynamic_range"] == pytest.approx(want, abs=1e-6), (tensor, variant)
        checked += 1
    assert checked == 3 * 6  # 3 tensors x (actual, nvfp4, block) x (row-wise, column-wise)
    # Hand-worked: MXFP8 1x32 blocks; NVFP4's 16x16 weight tiles.
    hand = {("activation", "actual"): 6.0, ("activation", "actual_columnwise"): 3.0,
            ("gradient", "actual"): 2.0, ("gradient", "actual_columnwise"): 4.0, ("weight", "nvfp4"): 8.0}
    for (tensor, variant), want in hand.items():
        assert local[(0, "0", tensor, variant)]["max_blockwise_dynamic_range"] == pytest.approx(want)

    stored = {
        "mlflow": _variant_rows(load_run(f"mlflow:{ml.run_id}", tracking_uri=uri)),
        "wandb": _wandb_table_rows(str(find_wandb_run(tmp_path / "wandb"))),
    }
    for src, got in stored.items():
        assert set(got) == set(local), src
        for k, stats in local.items():
            want = stats.get("max_blockwise_dynamic_range")
            have = got[k].get("max_blockwise_dynamic_range")
            assert (have is None or (isinstance(have, float) and math.isnan(have))) if want is None else (
                have == pytest.approx(want, rel=1e-6)), (src, k)
