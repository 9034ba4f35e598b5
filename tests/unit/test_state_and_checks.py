"""One way to checkpoint detector state (errors.save_state / restore_state) and one integer check
(errors.check_int, which refuses True as 1)."""

from __future__ import annotations

import json

import pytest
import torch

from fp8track.analysis.baseline import Baseline, classify_spike
from fp8track.analysis.divergence import DivergenceConfig, DivergenceDetector
from fp8track.analysis.drift import DriftConfig, DriftTracker, WhatIfDelayed
from fp8track.analysis.spikes import SpikeConfig, SpikeDetector, SpikeEvent
from fp8track.errors import ConfigError, check_int, restore_state, save_state
from fp8track.examples.gpt import GPTConfig
from fp8track.monitoring.monitor import CaptureConfig as MonitorConfig
from fp8track.monitoring.records import StepBatch
from fp8track.numerics.scaling import DelayedScaler


def _spikes() -> SpikeDetector:
    det = SpikeDetector(SpikeConfig(window=8, warmup=8))
    for s in range(20):
        det.update(s, 2.0 + 0.01 * (-1) ** s + (3.0 if s == 15 else 0.0))
    return det


def _divergence() -> DivergenceDetector:
    det = DivergenceDetector(DivergenceConfig(window=10, patience=3, smooth=3, start_phase_steps=5))
    for s in range(40):
        det.update(s, 4.0 - 0.01 * s + (0.05 * (s - 30) if s > 30 else 0.0), baseline_loss=4.0 - 0.01 * s)
    return det


def _drift() -> DriftTracker:
    tr = DriftTracker(DriftConfig(threshold_log2=1.0, consecutive=3))
    for s, d in enumerate([0.1, 1.5, 1.6, 1.7, 1.8, -2.0]):
        tr.update(s, "fc1", "weight", d)
    tr.update(6, "fc2", "gradient", 2.5)
    return tr


def _whatif() -> WhatIfDelayed:
    w = WhatIfDelayed("hybrid", history_len=4)
    for s, a in enumerate([1.0, 3.0, 0.5]):
        w.observe_many(s, {("fc1", "activation"): a, ("fc1", "gradient"): 10 * a})
    return w


def _scaler() -> DelayedScaler:
    sc = DelayedScaler("e4m3", history_len=4)
    for v in (1.0, 7.0, 2.0):
        sc.quantize(torch.full((4,), v))
    return sc


STATEFUL = {
    "SpikeDetector": (_spikes, lambda: SpikeDetector(SpikeConfig(window=8, warmup=8))),
    "DivergenceDetector": (
        _divergence,
        lambda: DivergenceDetector(DivergenceConfig(window=10, patience=3, smooth=3, start_phase_steps=5)),
    ),
    "DriftTracker": (_drift, lambda: DriftTracker(DriftConfig(threshold_log2=1.0, consecutive=3))),
    "WhatIfDelayed": (_whatif, lambda: WhatIfDelayed("hybrid", history_len=4)),
    "DelayedScaler": (_scaler, lambda: DelayedScaler("e4m3", history_len=4)),
}


def _plain(state):
    """JSON round trip (DelayedScaler's tensors become lists first)."""
    return json.loads(
        json.dumps({k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in state.items()})
    )


@pytest.mark.parametrize("name", list(STATEFUL))
def test_every_state_is_versioned_plain_data_and_round_trips(name):
    used, fresh = STATEFUL[name]
    a = used()
    state = a.state_dict()
    assert isinstance(state["version"], int) and state["version"] >= 1
    b = fresh()
    b.load_state_dict(_plain(state))
    assert _plain(b.state_dict()) == _plain(state)
    # missing keys keep the current value; unknown keys of the same version are ignored
    c = fresh()
    c.load_state_dict(_plain(state))
    c.load_state_dict({"version": state["version"], "from_a_later_release": 1})
    assert _plain(c.state_dict()) == _plain(state)


@pytest.mark.parametrize("name", list(STATEFUL))
def test_a_future_state_version_is_a_clear_config_error(name):
    used, fresh = STATEFUL[name]
    state = dict(used().state_dict())
    state["version"] = state["version"] + 1
    with pytest.raises(
        ConfigError, match=rf"{name} state has version \d+; this fp8track reads versions 1\.\.\d+.*upgrade"
    ):
        fresh().load_state_dict(state)
    for bad in (True, "1", 0):
        with pytest.raises(ConfigError, match=f"{name} state has version"):
            fresh().load_state_dict({**state, "version": bad})


def test_drift_state_names_its_fields_and_still_reads_version_1():
    a = _drift()
    state = a.state_dict()
    assert state["version"] == 2
    assert state["runs"][0] == {
        "layer": "fc1",
        "tensor": "weight",
        "sign": -1,
        "count": 1,
        "start_step": 5,
        "peak": -2.0,
        "fired": False,
    }
    # the version-1 layout (runs by position) of the same state restores the same tracker
    v1 = {
        "version": 1,
        "runs": [
            [r["layer"], r["tensor"], r["sign"], r["count"], r["start_step"], r["peak"], r["fired"]]
            for r in state["runs"]
        ],
        "events": state["events"],
    }
    b = DriftTracker(DriftConfig(threshold_log2=1.0, consecutive=3))
    b.load_state_dict(v1)
    assert b.state_dict() == state
    # and both continue identically: fc2's excursion fires on its third sample
    assert [e.step for e in a.update(7, "fc2", "gradient", 2.0) + a.update(8, "fc2", "gradient", 2.0)] == [8]
    assert [e.step for e in b.update(7, "fc2", "gradient", 2.0) + b.update(8, "fc2", "gradient", 2.0)] == [8]


def test_restore_state_helper():
    class Box:
        x = 1
        y: list[int] = []

    box = Box()
    got = []
    version = restore_state(
        box, save_state(x="7", y=None, z=3), {"x": ("x", int), "y": ("y", list), "z": got.append}
    )
    assert version == 1 and box.x == 7 and box.y is None and got == [3]
    assert restore_state(box, {"x": 2}, {"x": ("x", int)}) == 1 and box.x == 2  # no version: read as 1
    with pytest.raises(ConfigError, match="Box state must be a mapping, got list"):
        restore_state(box, [1], {})
    with pytest.raises(ConfigError, match="state version must be an integer >= 1"):
        save_state(version=0)


# --- integers: one check, and True is not 1 --------------------------------------------------------


def test_check_int_refuses_bools_and_floats():
    check_int("n", 3, 1)
    for bad in (True, False, 2.0, "2", 0):
        with pytest.raises(ConfigError, match=r"n must be an integer >= 1, got"):
            check_int("n", bad, 1)


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: MonitorConfig(steps=(5, True)), "steps entry must be an integer >= 0, got True"),
        (lambda: StepBatch(step=True), "StepBatch.step must be an integer >= 0, got True"),
        (lambda: GPTConfig(n_layer=True), "n_layer must be an integer >= 1, got True"),
        (lambda: GPTConfig(vocab=True), "vocab must be an integer >= 16, got True"),
        (
            lambda: classify_spike(
                SpikeEvent("spike", 1, 1, 5.0, 3.0, 0.1, 20.0, 1, 2, None, "recovered"),
                Baseline("b", {}, ()),
                window=True,
            ),
            "window must be an integer >= 0, got True",
        ),
    ],
)
def test_true_is_not_an_integer_anywhere(build, match):
    with pytest.raises(ConfigError, match=match):
        build()
