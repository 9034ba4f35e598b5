"""One pair of real runs (FP8 + BF16 control), recorded at once into a run directory, MLflow on
SQLite and an offline W&B run, read back from each: the same loss at every optimizer step, the same
data fingerprint, the same diagnosis."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("mlflow")
pytest.importorskip("wandb")

from fp8track import Monitor, apply_fp8  # noqa: E402
from fp8track.analysis.baseline import load_run  # noqa: E402
from fp8track.analysis.diagnose import diagnose  # noqa: E402
from fp8track.analysis.loss_gap import judge_gap, same_batches  # noqa: E402
from fp8track.execution.faults import Fault, plant  # noqa: E402
from fp8track.monitoring.monitor import data_fingerprint  # noqa: E402
from fp8track.trackers.mlflow import MLflowTracker  # noqa: E402
from fp8track.trackers.wandb import WandbTracker, find_wandb_run  # noqa: E402

from helpers.models import mlp

pytestmark = pytest.mark.slow

STEPS = 60
EVERY = 7  # sampled steps 0, 7, 14...: most steps are unsampled


def _train(tmp_path, name: str, fp8: bool, uri: str, experiment: str) -> dict:
    model = mlp(32, 64, 64, 8)
    if fp8:
        apply_fp8(model, "current", backend="emulated")
    wandb_dir = tmp_path / f"wandb_{name}"
    wandb_dir.mkdir()
    ml = MLflowTracker(tracking_uri=uri, experiment_name=experiment, run_name=name)
    wb = WandbTracker.create(project="fp8track-sources", name=name, dir=str(wandb_dir), mode="offline")
    mon = Monitor(model, {"every_n_steps": EVERY}, log_dir=tmp_path / "runs", trackers=[ml, wb])
    gen = torch.Generator().manual_seed(1)  # the same batches, in the same order, in both runs
    order = torch.randperm(STEPS, generator=gen)
    mon.record_data(data_fingerprint(seed=1, order=order))
    torch.manual_seed(5)
    target = nn.Linear(32, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    # a planted, lasting fault: from step 30 the FP8 run's middle layer loses 60 of its 64 inputs
    flush = Fault("weight_flush", "weight", windows=((30, None),), channels=tuple(range(60)))
    fault = plant(model, flush, ["2"]) if fp8 else None
    for step in range(STEPS):
        if fault is not None:
            fault.before_step(step)
        g = torch.Generator().manual_seed(int(order[step]))
        x = torch.randn(16, 32, generator=g)
        y = target(x).detach()
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        mon.step(loss=loss)
        opt.zero_grad()
    mon.close()
    return {"dir": mon.run_dir, "mlflow": f"mlflow:{ml.run_id}", "wandb": find_wandb_run(wandb_dir)}


def test_run_dir_mlflow_and_wandb_give_the_same_losses_and_findings(tmp_path, mlflow_store):
    uri, exp = mlflow_store.uri, mlflow_store.experiment()
    refs = {
        "fp8": _train(tmp_path, "fp8", True, uri, exp),
        "control": _train(tmp_path, "control", False, uri, exp),
    }
    runs = {
        src: {k: load_run(r[src], tracking_uri=uri) for k, r in refs.items()}
        for src in ("dir", "mlflow", "wandb")
    }

    ref_loss = {k: runs["dir"][k].metrics["fp8/loss"] for k in refs}
    for k in refs:
        assert sorted(ref_loss[k]) == list(range(STEPS))  # every optimizer step, not only the sampled
    for src in ("mlflow", "wandb"):
        for k in refs:
            got = runs[src][k].metrics["fp8/loss"]
            assert sorted(got) == list(range(STEPS)), (src, k)
            assert got == pytest.approx(ref_loss[k], rel=1e-6), (src, k)
        # the data fingerprint survives every store, so each source knows the batches were the same
        assert same_batches(runs[src]["fp8"].meta, runs[src]["control"].meta), src
    assert same_batches(runs["dir"]["fp8"].meta, runs["dir"]["control"].meta)

    judged = {src: judge_gap(r["fp8"].metrics["fp8/loss"], r["control"].metrics["fp8/loss"], paired=True)
              for src, r in runs.items()}
    # healthy steps of the pair agree within 0.5 %; the plant shows from step 30's loss on
    assert judged["dir"].lasting and 29 <= judged["dir"].onset_step <= 33, judged["dir"].to_dict()
    for src in ("mlflow", "wandb"):
        assert (judged[src].lasting, judged[src].onset_step) == (
            judged["dir"].lasting,
            judged["dir"].onset_step,
        )

    diags = {src: diagnose(r["fp8"], r["control"]) for src, r in runs.items()}
    kinds = {src: d.kinds() for src, d in diags.items()}
    assert kinds["mlflow"] == kinds["dir"] == kinds["wandb"], kinds
    verdicts = {src: d.verdict for src, d in diags.items()}
    assert verdicts["mlflow"] == verdicts["dir"] == verdicts["wandb"], verdicts
