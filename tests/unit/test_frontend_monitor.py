"""fp8track.Monitor, the plain-loop frontend: ``baseline=`` in every reference form, loaded before
training; the with-block; the one default run folder; wrappers looked through."""

from __future__ import annotations

import os

import pytest
import torch

import fp8track
from fp8track.config import DEFAULT_LOG_DIR
from fp8track.frontend import unwrap_model
from fp8track.monitoring.naming import LOSS_METRIC, run_metric
from fp8track.monitoring.records import RunReader

from helpers.models import mlp

GAP = run_metric("loss_gap_vs_baseline")


def _run(monitor: fp8track.Monitor, losses: list[float]) -> None:
    with monitor:
        for v in losses:
            monitor.model(torch.ones(2, 4)).sum().backward()
            monitor.step(loss=v)


def _metrics(run_dir, key):
    return {m.step: m.metrics[key] for m in RunReader(run_dir).metrics() if key in m.metrics}


def test_baseline_as_a_run_directory_path_feeds_the_loss_gap(tmp_path):
    control = fp8track.Monitor(mlp(4, 8, 1), {"every_n_steps": 1}, log_dir=tmp_path)
    _run(control, [3.0, 2.5, 2.0, 1.5])
    # the path as a string, and as a Path: loaded at construction, the gap = loss - control loss
    for ref in (str(control.run_dir), control.run_dir):
        fp8 = fp8track.Monitor(mlp(4, 8, 1), {"every_n_steps": 2}, log_dir=tmp_path, baseline=ref)
        _run(fp8, [3.5, 2.5, 2.25, 1.0])
        # at the flushes: sampled steps 0 and 2, and close() flushing step 3 (1.0 - 1.5)
        assert _metrics(fp8.run_dir, GAP) == pytest.approx({0: 0.5, 2: 0.25, 3: -0.5})
        assert not [e for e in fp8.events if e.kind == "analysis_error"]


def test_baseline_from_mlflow_with_the_tracking_uri(tmp_path, mlflow_store):
    from fp8track.trackers.mlflow import MLflowTracker

    uri = mlflow_store.uri
    tracker = MLflowTracker(
        tracking_uri=uri, experiment_name=mlflow_store.experiment(), background=False, heatmap=False
    )
    control = fp8track.Monitor(mlp(4, 8, 1), {"every_n_steps": 1}, log_dir=tmp_path, trackers=[tracker])
    _run(control, [2.0, 1.0])
    fp8 = fp8track.Monitor(
        mlp(4, 8, 1),
        {"every_n_steps": 1},
        log_dir=tmp_path,
        baseline=f"mlflow:{tracker.run_id}",
        tracking_uri=uri,
    )
    _run(fp8, [2.5, 0.5])
    assert _metrics(fp8.run_dir, GAP) == pytest.approx({0: 0.5, 1: -0.5})


def test_a_bad_baseline_is_refused_before_any_hook_or_file(tmp_path):
    with pytest.raises(fp8track.ConfigError, match="control must be a run directory"):
        fp8track.Monitor(mlp(4, 8, 1), log_dir=tmp_path, baseline=42)
    with pytest.raises(fp8track.ConfigError, match="does not exist"):
        fp8track.Monitor(mlp(4, 8, 1), log_dir=tmp_path, baseline=tmp_path / "missing")
    assert os.listdir(tmp_path) == []  # nothing written


def test_with_block_closes_and_writes_pending_losses_even_when_the_loop_raises(tmp_path):
    mon = fp8track.Monitor(mlp(4, 8, 1), {"every_n_steps": 10}, log_dir=tmp_path)
    with pytest.raises(RuntimeError, match="user code"):
        with mon:
            for v in (1.0, 2.0, 3.0):  # step 0 is sampled; steps 1 and 2 wait for a flush
                mon.step(loss=v)
            raise RuntimeError("user code failed")
    assert mon.closed
    assert _metrics(mon.run_dir, LOSS_METRIC) == {0: 1.0, 1: 2.0, 2: 3.0}
    assert [e.kind for e in mon.events][-1] == "run_end"


def test_default_run_folder_is_fp8track_runs_in_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with fp8track.Monitor(mlp(4, 8, 1)) as mon:
        mon.step(loss=1.0)
    assert (
        DEFAULT_LOG_DIR == "fp8track-runs"
        and mon.run_dir.resolve().parent == tmp_path.resolve() / "fp8track-runs"
    )


def test_unwrap_model_looks_through_fabric_and_peft_wrappers():
    from lightning.fabric.wrappers import _FabricModule

    net = mlp(4, 8, 1)
    wrapped = _FabricModule(net, strategy=None)
    assert unwrap_model(wrapped) is net and unwrap_model(net) is net
    assert any(n.startswith("_forward_module.") for n, _ in wrapped.named_modules())


def _loop(monitor: fp8track.Monitor, steps: int, step_after_zero_grad: bool) -> list[float]:
    """A plain loop; returns the gradient norm of each step, measured by hand before zero_grad."""
    opt = torch.optim.SGD(monitor.model.parameters(), lr=0.1)
    norms = []
    for i in range(steps):
        loss = monitor.model(torch.full((2, 4), float(i + 1))).square().mean()
        loss.backward()
        grads = [p.grad.norm() for p in monitor.model.parameters()]
        norms.append(float(torch.linalg.vector_norm(torch.stack(grads))))
        opt.step()
        if step_after_zero_grad:
            opt.zero_grad()
            monitor.step(loss=loss)
        else:
            monitor.step(loss=loss)
            opt.zero_grad()
    return norms


def test_step_after_zero_grad_is_warned_once_and_records_no_grad_norm(tmp_path):
    norm_key = run_metric("grad_norm")
    with fp8track.Monitor(mlp(4, 8, 1), {"every_n_steps": 1}, log_dir=tmp_path) as good:
        norms = _loop(good, 3, step_after_zero_grad=False)
    assert list(_metrics(good.run_dir, norm_key).values()) == pytest.approx(norms, rel=1e-6)
    with pytest.warns(UserWarning, match="no parameter had a gradient") as caught:
        with fp8track.Monitor(mlp(4, 8, 1), {"every_n_steps": 1}, log_dir=tmp_path) as late:
            _loop(late, 3, step_after_zero_grad=True)
    assert sum("no parameter had a gradient" in str(w.message) for w in caught) == 1
    # attributed to the user's line that called monitor.step (here _loop), not to the package
    assert [w.filename for w in caught if "no parameter" in str(w.message)] == [__file__]
    assert _metrics(late.run_dir, norm_key) == {}


def test_the_low_fp8_share_warning_points_at_the_users_step_call(tmp_path):
    """The first layer (4x256, 80 % of the FLOPs) kept in BF16: the share warning fires at the
    first sampled step and names the line of this file that called ``monitor.step``, as every
    warning of the monitor's step does (it named ``monitoring/monitor.py``)."""
    from fp8track.execution.apply import apply_fp8

    model = mlp(4, 256, 1)
    report = apply_fp8(model, "current", bf16_layers="first", backend="emulated")
    with pytest.warns(UserWarning, match="GEMM FLOPs ran in FP8") as caught:
        with fp8track.Monitor(model, {"every_n_steps": 1}, log_dir=tmp_path, apply_report=report) as mon:
            _loop(mon, 2, step_after_zero_grad=False)
    share = [w for w in caught if "GEMM FLOPs ran in FP8" in str(w.message)]
    assert len(share) == 1 and share[0].filename == __file__, [(w.filename, w.lineno) for w in share]


def test_a_monitor_never_attached_says_its_first_step_ran_unobserved(tmp_path):
    mon = fp8track.Monitor(mlp(4, 8, 1), {"every_n_steps": 1}, log_dir=tmp_path)
    with pytest.warns(UserWarning, match="end of step 0, so that step.s forward and backward ran unobserved"):
        _loop(mon, 2, step_after_zero_grad=False)
    mon.close()
    rows = RunReader(mon.run_dir).tensor_stats()
    assert {r.step for r in rows} == {1}  # step 0 ran before the hooks existed


def test_a_loss_of_several_elements_is_a_config_error_naming_its_shape(tmp_path):
    with fp8track.Monitor(mlp(4, 8, 1), {"every_n_steps": 1}, log_dir=tmp_path) as mon:
        mon.model(torch.ones(2, 4)).sum().backward()
        with pytest.raises(fp8track.ConfigError, match=r"one number .* shape \(2,\).*loss.mean\(\)"):
            mon.step(loss=torch.tensor([1.0, 2.0]))
        mon.step(loss=torch.tensor([[1.5]]))  # one element in any shape is one number
    assert _metrics(mon.run_dir, LOSS_METRIC) == {0: 1.5}
