"""A trial's command line, expanded as ``wandb agent`` expands it (wandb/wandb_agent.py and
wandb/sdk/launch/sweeps/utils.py ``create_sweep_command_args``), and the program's hash."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from fp8track.errors import ConfigError
from fp8track.sweep.command import DEFAULT_COMMAND, check_command, expand, program_hash

PARAMS = {"recipe": "delayed:hybrid:h16:max", "lr": 0.001, "compile": False, "amp": True}


def test_default_command_is_wandbs_and_args_are_str_of_each_value() -> None:
    argv = expand(DEFAULT_COMMAND, "train.py", PARAMS)
    assert argv == [
        "/usr/bin/env",
        sys.executable,
        "train.py",
        "--recipe=delayed:hybrid:h16:max",
        "--lr=0.001",
        "--compile=False",
        "--amp=True",
    ]


def test_every_macro(tmp_path: Path) -> None:
    cmd = [
        "torchrun",
        "--nproc_per_node=2",
        "${program}",
        "${args_no_hyphens}",
        "--",
        "${args_no_boolean_flags}",
        "${args_json_file}",
        "--tag=${envvar:MY_TAG}-x",
    ]
    jf = tmp_path / "args.json"
    argv = expand(cmd, "train.py", PARAMS, json_file=jf, env={"MY_TAG": "t1"})
    assert argv == [
        "torchrun",
        "--nproc_per_node=2",
        "train.py",
        "recipe=delayed:hybrid:h16:max",
        "lr=0.001",
        "compile=False",
        "amp=True",
        "--",
        "--recipe=delayed:hybrid:h16:max",
        "--lr=0.001",
        "--amp",
        str(jf),
        "--tag=t1-x",
    ]
    assert json.loads(jf.read_text()) == PARAMS
    assert expand(["${args_json}"], "p", {"a": 1}) == ['{"a": 1}']


def test_unknown_macro_and_bad_command_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"command macro '\$\{argz\}'; valid values are: .*\$\{args\}"):
        check_command(["${env}", "${argz}"], "sweep")
    with pytest.raises(ConfigError, match="non-empty list"):
        check_command("python train.py", "sweep")
    assert check_command(["${env}", "--x=${envvar:HOME}"], "s") == ("${env}", "--x=${envvar:HOME}")


def test_program_hash_follows_the_source_and_the_command(tmp_path: Path) -> None:
    prog = tmp_path / "train.py"
    prog.write_text("print(1)\n")
    h1 = program_hash("train.py", DEFAULT_COMMAND, tmp_path)
    assert program_hash("train.py", DEFAULT_COMMAND, tmp_path) == h1
    assert program_hash("train.py", ["${interpreter}", "${program}"], tmp_path) != h1
    prog.write_text("print(2)\n")
    assert program_hash("train.py", DEFAULT_COMMAND, tmp_path) != h1
    assert len(program_hash("fp8track.examples.train", DEFAULT_COMMAND, tmp_path)) == 16  # a module
    with pytest.raises(ConfigError, match="neither a file"):
        program_hash("missing.py", DEFAULT_COMMAND, tmp_path)
