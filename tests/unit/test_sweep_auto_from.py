"""``auto:K`` from what-if rows (issue 23): the option is validated before anything runs, the
controls record the what-if variants of the sweep's recipes, and the program's settings carry them."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from fp8track.errors import ConfigError
from fp8track.sweep.controls import control_whatif
from fp8track.sweep.options import SweepOptions
from fp8track.sweep.spec import load_sweep
from fp8track.trial import WHATIF_ENV, trial_settings, whatif_variant


def _spec(recipe, bf16_layers):
    def body(v):
        return {"values": v} if isinstance(v, list) else {"value": v}

    return load_sweep({"name": "s", "program": "train.py", "method": "grid",
                       "metric": {"name": "val/loss", "goal": "minimize"},
                       "parameters": {"recipe": body(recipe), "bf16_layers": body(bf16_layers)}})


def test_auto_from_is_validated_naming_the_valid_values(tmp_path: Path) -> None:
    assert SweepOptions(trials=1, out=tmp_path).auto_from == "probe"
    with pytest.raises(ConfigError, match=r"'whatever'.*'probe', 'whatif'"):
        SweepOptions(trials=1, out=tmp_path, auto_from="whatever")


def test_controls_record_the_whatif_of_every_recipe_auto_k_may_need() -> None:
    spec = _spec(["nvfp4", "mxfp8:e4m3", "nvfp4:no_rht", "bf16"], ["none", "auto:2"])
    assert control_whatif(spec, "whatif") == ("nvfp4", "mxfp8")
    assert control_whatif(spec, "probe") == ()
    assert control_whatif(_spec(["nvfp4"], ["none", "last:15%,head"]), "whatif") == ()  # no auto:K
    with pytest.raises(ConfigError, match=r"'delayed'; valid values are: 'mxfp8', 'block', 'nvfp4'"):
        control_whatif(_spec(["nvfp4", "delayed"], "auto:1"), "whatif")


def test_whatif_variant_and_the_programs_settings(monkeypatch) -> None:
    assert whatif_variant("block") == "block" and whatif_variant("nvfp4:no_sr") == "nvfp4"
    with pytest.raises(ConfigError, match="current"):
        whatif_variant("current")
    assert trial_settings([], param_path="").whatif == ()
    monkeypatch.setenv(WHATIF_ENV, "nvfp4,mxfp8")
    assert trial_settings([], param_path="").whatif == ("nvfp4", "mxfp8")
    monkeypatch.setenv(WHATIF_ENV, "fp4")
    with pytest.raises(ConfigError, match=r"'fp4'.*'nvfp4'"):
        trial_settings([], param_path="")


def test_cli_refuses_a_bad_auto_from_in_one_line_before_training(tmp_path: Path, capsys) -> None:
    from fp8track.cli import main

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"name": "s", "program": "train.py", "method": "grid",
                                    "metric": {"name": "val/loss"},
                                    "parameters": {"recipe": {"value": "delayed"},
                                                   "bf16_layers": {"value": "auto:1"}}}))
    out = tmp_path / "out"
    assert main(["sweep", str(path), "--out", str(out), "--auto-from", "control"]) == 2
    assert main(["sweep", str(path), "--out", str(out), "--auto-from", "whatif"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "'control'" in err[0] and "'delayed'" in err[1]
    assert not (out / "mlflow.db").exists()
