"""API inputs that used to fail late or silently: a bare string where a list is expected, an
empty layer list, a regex that does not compile, the trackers' string forms, and the sweep
loader's wording. Each is refused at construction or means what it says."""

from __future__ import annotations

import pytest
import torch

import fp8track
from fp8track import ConfigError, MonitorConfig
from fp8track.monitoring.records import RunReader


def test_a_bare_string_is_a_one_element_list(tmp_path):
    (tmp_path / "c.yaml").write_text(
        "tensors: activation\nwhatif: mxfp8\nscalar_stats: mse\nburst_on: spike\n"
    )
    cfg = MonitorConfig.load(tmp_path / "c.yaml")
    assert (cfg.tensors, cfg.whatif, cfg.scalar_stats, cfg.burst_on) == (
        ("activation",), ("mxfp8",), ("mse",), ("spike",),
    )  # fmt: skip
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with fp8track.Monitor(model, cfg.replace(every_n_steps=1), log_dir=tmp_path, trackers="none") as mon:
        model(torch.randn(4, 8)).sum().backward()
        mon.step(loss=1.0)
    rows = list(RunReader(mon.run_dir).tensor_stats())
    assert {(r.tensor, r.variant) for r in rows} == {("activation", "shadow"), ("activation", "mxfp8"),
                                                    ("activation", "mxfp8_columnwise")}
    with pytest.raises(ConfigError, match="unknown tensor kind 'activations'"):
        MonitorConfig(tensors="activations")


@pytest.mark.parametrize(
    "layers, needle",
    [
        ([], r"layers=\[\] selects no layer"),
        ("re:fc[", "does not compile"),
        (["0", 3], "non-empty strings, got 3"),
        (7, "got int 7"),
    ],
)
def test_layer_selectors_are_checked_at_construction(tmp_path, layers, needle):
    from fp8track.hf import FP8TrainerCallback
    from fp8track.lightning import FP8Monitor

    for build in (
        lambda: fp8track.Monitor(torch.nn.Linear(4, 4), log_dir=tmp_path / "runs", layers=layers),
        lambda: FP8Monitor(layers=layers),
        lambda: FP8TrainerCallback(layers=layers),
    ):
        with pytest.raises(ConfigError, match=needle):
            build()
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("spec", ["none", "auto", (), []])
def test_tracker_string_forms_work_and_write_only_the_run_dir(tmp_path, spec):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with fp8track.Monitor(model, {"every_n_steps": 1}, log_dir=tmp_path, trackers=spec) as mon:
        model(torch.randn(2, 4)).sum().backward()
        mon.step(loss=0.5)
    assert RunReader(mon.run_dir).series() == {0: 0.5}


def test_sweep_loader_wording():
    from fp8track.sweep.spec import load_sweep

    base = {"program": "train.py", "metric": {"name": "val_loss", "goal": "minimize"},
            "parameters": {"recipe": {"values": ["current"]}, "bf16_layers": {"values": ["none"]}}}
    with pytest.raises(ConfigError) as info:
        load_sweep(base)
    assert str(info.value) == "sweep: no method given; valid values are: 'grid', 'random', 'bayes'"
    with pytest.raises(ConfigError) as info:
        load_sweep({**base, "method": "grid", "metric": {"name": "val_loss", "goal": "maximise"}})
    assert (
        str(info.value) == "sweep: unknown metric goal 'maximise'; valid values are: 'minimize', 'maximize'"
    )
