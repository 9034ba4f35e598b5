"""The sweep YAML: the shipped files pass the W&B schema and our rules; each bad input is refused
before any training with a message naming the problem."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from fp8track.errors import ConfigError
from fp8track.sweep.spec import load_sweep

ROOT = Path(__file__).resolve().parents[2]
SWEEP = ROOT / "integrations" / "wandb" / "fp8_sweep.yaml"
GRID = ROOT / "integrations" / "wandb" / "fp8_grid.yaml"


def _base() -> dict:
    return yaml.safe_load(SWEEP.read_text())


def _write(tmp_path: Path, cfg: dict | str) -> Path:
    p = tmp_path / "sweep.yaml"
    p.write_text(cfg if isinstance(cfg, str) else yaml.safe_dump(cfg))
    return p


def test_shipped_sweeps_pass_the_wandb_schema_and_our_rules() -> None:
    pytest.importorskip("sweeps")
    spec = load_sweep(SWEEP, require_schema=True)
    assert spec.schema_checked
    assert (spec.method, spec.metric, spec.goal) == ("bayes", "fp8/val_loss", "minimize")
    assert spec.command == ("${env}", "${interpreter}", "-m", "${program}", "${args}")
    assert spec.param("recipe").values == (
        "delayed:hybrid:h16:max",
        "delayed:hybrid:h1024:max",
        "current",
        "mxfp8",
        "block",
        "fp8_input_bf16_gemm",
    )
    assert spec.param("bf16_layers").values == (
        "none",
        "first:1",
        "last:1",
        "first_last",
        "first:2",
        "last:2",
        "auto:1",
        "auto:2",
        "auto:4",
    )
    assert spec.hyperband is not None and (spec.hyperband.min_iter, spec.hyperband.eta) == (2, 2)
    grid = load_sweep(GRID, require_schema=True)
    assert grid.method == "grid" and grid.grid_size == 6 * 9


def test_the_sweeps_package_itself_rejects_a_bad_method() -> None:
    """Independent of our rules: the W&B schema as the sweeps package ships it."""
    sweeps = pytest.importorskip("sweeps")
    cfg = _base()
    assert sweeps.schema_violations_from_proposed_config(cfg) == []
    cfg["method"] = "annealing"
    assert sweeps.schema_violations_from_proposed_config(cfg)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda c: c.update(method="annealing"),
            r"unknown .*method 'annealing'; valid values are: 'grid', 'random', 'bayes'",
        ),
        (lambda c: c.update(method="custom"), r"'custom' needs a W&B server"),
        (
            lambda c: c["parameters"]["bf16_layers"].update(values=[]),
            r"parameter 'bf16_layers' has no values",
        ),
        (
            lambda c: c["parameters"].update(lr={"distribution": "uniform"}),
            r"parameter 'lr' needs exactly one of value, values or min/max",
        ),
        (
            lambda c: c["parameters"]["recipe"]["values"].append("delayed:h16:fancy"),
            r"parameter 'recipe' value 'delayed:h16:fancy' does not parse: cannot parse token 'fancy'",
        ),
        (
            lambda c: c["parameters"]["recipe"]["values"].append("fp4"),
            r"value 'fp4' does not parse: unknown recipe name 'fp4'",
        ),
        (
            lambda c: c["parameters"]["bf16_layers"]["values"].append("auto:0"),
            r"value 'auto:0' does not parse: bf16_layers term 'auto:0' needs a positive integer count",
        ),
        (  # a misspelt keyword: refused here, not after the trials that run it have failed
            lambda c: c["parameters"]["bf16_layers"]["values"].append("lst:1"),
            r"value 'lst:1' does not parse: bf16_layers term 'lst:1': unknown keyword 'lst'; valid forms: "
            r"none, first, last",
        ),
        (
            lambda c: c["parameters"].update(lerning_rate={"values": [1e-3]}),
            r"parameter \(not an option of the sweep program\) 'lerning_rate'",
        ),
        (
            lambda c: c["parameters"].update(fp8={"parameters": {"recipe": {"values": ["current"]}}}),
            r"nested|fp8",
        ),
        (
            lambda c: c["parameters"].update(steps={"value": 0}),
            r"parameter 'steps' value 0 is invalid: steps must be an integer >= 1",
        ),
        (lambda c: c.update(early_terminate={"type": "envelope"}), r"early_terminate type 'envelope'"),
        (
            lambda c: c.update(early_terminate={"type": "hyperband"}),
            r"hyperband needs min_iter, or max_iter together with s",
        ),
        (lambda c: c.update(metric={"goal": "minimize"}), r"metric must be a mapping with a name"),
        (lambda c: c.pop("program"), r"program is missing"),
        (
            lambda c: c.update(command=["${env}", "${interpreter}", "${progam}"]),
            r"command macro '\$\{progam\}'",
        ),
    ],
)
def test_bad_sweeps_are_refused_naming_the_problem(tmp_path: Path, mutate, message: str) -> None:
    cfg = _base()
    mutate(cfg)
    with pytest.raises(ConfigError, match=message):
        load_sweep(_write(tmp_path, cfg))


def test_unsafe_yaml_tag_is_refused(tmp_path: Path) -> None:
    text = SWEEP.read_text() + "\nexploit: !!python/object/apply:os.system ['echo pwned']\n"
    with pytest.raises(ConfigError, match=r"unsafe or unknown YAML tag"):
        load_sweep(_write(tmp_path, text))


def test_users_program_may_take_any_parameter(tmp_path: Path) -> None:
    """Parameter names are checked against the example program's options only: a user's program
    has its own (here ``lerning_rate`` is its business)."""
    cfg = _base()
    cfg["program"] = "my_train.py"
    cfg["parameters"]["lerning_rate"] = {"values": [1e-3, 3e-3]}
    spec = load_sweep(_write(tmp_path, cfg))
    assert spec.program == "my_train.py" and spec.param("lerning_rate").values == (1e-3, 3e-3)


def test_spec_that_does_not_fit_the_model_is_refused_by_the_program_before_training(
    tmp_path: Path, capsys
) -> None:
    """The example program refuses ``first:3`` on its two-block GPT: one line, exit 2, no run."""
    from fp8track.examples.train import main

    out = tmp_path / "out"
    rc = main(
        [
            "--recipe=current",
            "--bf16_layers=first:3",
            "--steps=1",
            "--n_embd=16",
            "--n_head=1",
            "--block_size=8",
            "--max_bytes=20000",
            "--control=" + str(_control_file(tmp_path)),
            f"--out={out}",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert "'first:3' asks for 3 blocks but stack 'model.blocks' has 2" in err[0]


def _control_file(tmp_path: Path) -> Path:
    import json

    p = tmp_path / "control.json"
    p.write_text(json.dumps({"val_loss": {}, "run_dir": str(tmp_path)}))
    return p


def test_hyperband_from_max_iter_and_s(tmp_path: Path) -> None:
    cfg = _base()
    cfg["early_terminate"] = {"type": "hyperband", "max_iter": 27, "s": 2, "eta": 3}
    spec = load_sweep(_write(tmp_path, cfg))
    assert (spec.hyperband.min_iter, spec.hyperband.max_iter, spec.hyperband.eta) == (3, 27, 3)


@pytest.mark.parametrize("word", [False, True])
def test_a_yaml_boolean_in_bf16_layers_is_refused_before_any_trial(word) -> None:
    """``bf16_layers: {values: [none, off]}`` reads ``off`` as False; it used to pass the check as
    the layer name 'False' and every trial with it failed in the program ("names a missing module
    'False'", three runs of a one-point grid)."""
    raw = {"name": "b", "program": "train.py", "method": "grid", "metric": {"name": "val/loss"},
           "parameters": {"recipe": {"value": "current"}, "bf16_layers": {"values": ["none", word]}}}
    with pytest.raises(ConfigError, match=f"'bf16_layers' value {word!r} is a YAML boolean"):
        load_sweep(raw)
