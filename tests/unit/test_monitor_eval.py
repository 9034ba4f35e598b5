"""What the diagnosis needs from training: evaluation metrics per evaluation (``fp8/eval/<name>``)
and the precision set-up in the run metadata."""

import math

import torch
from torch import nn

from fp8track import Monitor
from fp8track.analysis.baseline import load_run
from fp8track.execution.apply import apply_fp8
from fp8track.monitoring.monitor import precision_setup, select_eval_metrics

from helpers.models import mlp


def test_record_eval_writes_fp8_eval_records_read_back_as_eval_metrics(tmp_path):
    model = mlp(16, 32, 4)
    mon = Monitor(model, log_dir=tmp_path).attach()
    for _step in range(3):
        mon.step(loss=model(torch.randn(4, 16)).pow(2).mean())
    got = mon.record_eval(
        3, {"val_loss": torch.tensor(1.25), "val/acc": 0.5, "note": "text", "bad": math.nan}
    )
    mon.record_eval(6, {"val_loss": 1.0})
    mon.close()
    assert got == {"fp8/eval/val_loss": 1.25, "fp8/eval/val/acc": 0.5}
    run = load_run(mon.run_dir)
    assert run.eval_metrics() == {"val_loss": {3: 1.25, 6: 1.0}, "val/acc": {3: 0.5}}


def test_select_eval_metrics_auto_and_explicit():
    logged = {
        "train_loss": 1,
        "val_loss": 2,
        "val/acc": 3,
        "eval_f1": 4,
        "test_acc": 5,
        "validation": 6,
        "lr": 7,
    }
    assert select_eval_metrics(logged) == {"val_loss": 2, "val/acc": 3, "eval_f1": 4, "test_acc": 5}
    assert select_eval_metrics(logged, ["lr", "missing"]) == {"lr": 7}


def test_precision_setup_reads_the_model_and_optimizers(tmp_path):
    model = mlp(16, 32, 4)
    assert precision_setup(model) == {"recipe": None, "fp8_weights": False, "activation_checkpointing": False,
                                      "torch_compile": False, "fused_optimizer": None}
    apply_fp8(model, "current", backend="emulated")
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    setup = precision_setup(model, [opt], cpu_offloading=True)
    assert (
        setup["recipe"] == "current:hybrid:h1024:max:m0"
        and setup["fused_optimizer"] == "fused"
        and setup["cpu_offloading"] is True
    )
    model.compile()
    assert precision_setup(model)["torch_compile"] is True
    with torch.no_grad():
        model[0].weight = nn.Parameter(model[0].weight.to(torch.float8_e4m3fn), requires_grad=False)
    assert precision_setup(model)["fp8_weights"] is True
    mon = Monitor(mlp(16, 32, 4), log_dir=tmp_path).attach()
    mon.close()
    assert load_run(mon.run_dir).meta["config"]["precision"]["recipe"] is None
