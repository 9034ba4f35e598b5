"""``control=`` names the BF16 control run on every frontend; ``baseline=``, its former name,
still works for one release (with a DeprecationWarning) and both at once are refused."""

from __future__ import annotations

import pytest
from torch import nn

import fp8track
from fp8track.errors import ConfigError
from fp8track.frontend import control_arg
from fp8track.hf import FP8TrainerCallback
from fp8track.lightning import FP8Monitor


def test_control_arg_takes_either_name_once():
    assert control_arg("runs/a", None) == "runs/a"
    with pytest.warns(DeprecationWarning, match="control="):
        assert control_arg(None, "runs/b") == "runs/b"
    with pytest.raises(ConfigError, match="not both"):
        control_arg("runs/a", "runs/b")


def test_every_frontend_takes_control(tmp_path):
    missing = str(tmp_path / "nope")
    # the plain monitor loads the control at construction: a missing one is named either way
    for kw in ("control", "baseline"):
        with pytest.raises(ConfigError, match="nope"):
            fp8track.Monitor(nn.Linear(4, 4), {"every_n_steps": 1}, log_dir=tmp_path, trackers="none",
                             **{kw: missing})
    assert FP8Monitor(control="mlflow:abc").baseline == "mlflow:abc"
    with pytest.warns(DeprecationWarning):
        assert FP8Monitor(baseline="mlflow:abc").baseline == "mlflow:abc"
    assert FP8TrainerCallback(control="mlflow:abc").baseline == "mlflow:abc"
    with pytest.raises(ConfigError, match="not both"):
        FP8TrainerCallback(control="a", baseline="b")


def test_cli_diagnose_takes_control_and_its_former_name(capsys):
    from fp8track.cli import main

    for flag in ("--control", "--baseline"):
        assert main(["diagnose", "nowhere-a", flag, "nowhere-b"]) == 2
        assert "nowhere-a" in capsys.readouterr().err
