"""Commands that used to end in a traceback, accept nonsense or leave folders behind: each is now
one line on stderr, exit status 2, nothing on stdout, and nothing created in the working folder."""

from __future__ import annotations

import importlib.util
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SWEEP = str(REPO / "integrations" / "wandb" / "fp8_sweep.yaml")

LAUGHS = "".join(
    f"{a}: &{a} [{', '.join([f'*{prev}'] * 9) if prev else ', '.join(['lol'] * 9)}]\n"
    for prev, a in zip([None, *"abcdefgh"], "abcdefghi", strict=True)
)
"""A "billion laughs" YAML: nine lines whose aliases expand to 9^9 strings."""


class Pickled:
    """A class ``torch.load(weights_only=True)`` refuses (its error is several lines long)."""


def _files(tmp: Path) -> None:
    (tmp / "a-file").write_text("")
    (tmp / "laughs.yaml").write_text(LAUGHS + "method: *i\n")
    (tmp / "laughs-config.yaml").write_text(LAUGHS + "tensors: *i\n")
    (tmp / "not-a-checkpoint.pt").write_bytes(pickle.dumps(Pickled()))
    run = tmp / "run"
    run.mkdir()
    (run / "meta.json").write_text('{"run_id": "r", "name": "n"}')


CASES = [
    (("integrations", "--copy", "a-file"), ["--copy", "a-file", "not a folder"]),
    (("demo", "--out", "a-file"), ["--out", "a-file", "not a folder"]),
    (("demo", "--every-n-steps", "0"), ["--every-n-steps", ">= 1", "0"]),
    (
        ("sweep", SWEEP, "--storage", "bogus://x", "--trials", "1"),
        ["'bogus://x'", "sqlite://", "postgresql://"],
    ),
    (("sweep", SWEEP, "--summary"), ["no sweep store", "has not run there"]),
    (("sweep", SWEEP, "--trials", "1", "--seed", "-1"), ["--seed", "2**32 - 1", "-1"]),
    (("sweep", SWEEP, "--trials", "1", "--seed", str(2**32)), ["--seed", "4294967295", "4294967296"]),
    (
        ("sweep", SWEEP, "--trials", "1", "--storage", "sqlite:///no-such-folder/optuna.db"),
        ["--storage", "'no-such-folder'", "does not exist"],
    ),
    (("sweep", SWEEP, "--tolerance-factor", "nan"), ["--tolerance-factor", "finite", "nan"]),
    (("sweep", SWEEP, "--tolerance-floor", "-1"), ["--tolerance-floor", ">= 0", "-1"]),
    (("sweep", SWEEP, "--kill-grace", "-1"), ["--kill-grace", ">= 0", "-1"]),
    (("sweep", "laughs.yaml"), ["laughs.yaml", "more than 100,000 values", "aliases"]),
    (("sync", "run", "--wandb-dir", "a-file"), ["--wandb-dir", "a-file", "not a folder"]),
    (
        ("check-inference", "not-a-checkpoint.pt"),
        ["not-a-checkpoint.pt", "not an fp8track checkpoint", "UnpicklingError", "save_checkpoint"],
    ),
    (
        ("sync", "run", "--mlflow-uri", "postgresql://alice:s3cret@127.0.0.1/mlflow"),
        ["postgresql://***@127.0.0.1/mlflow", "driver", "not installed"],
    ),
]


@pytest.mark.parametrize("argv, must_say", CASES, ids=[" ".join(c[0][:3]) for c in CASES])
def test_one_line_exit_2_and_nothing_created(tmp_path, argv, must_say):
    if "postgresql://" in " ".join(argv) and importlib.util.find_spec("psycopg") is not None:
        pytest.skip("psycopg is installed: the postgresql:// driver is there")
    _files(tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    proc = subprocess.run(
        [sys.executable, "-m", "fp8track.cli", *argv], capture_output=True, text=True, timeout=300,
        cwd=tmp_path, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    lines = proc.stderr.strip().splitlines()
    assert proc.stdout == "" and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"fp8track {argv[0]}: error: ")
    assert len(lines[0]) < 400 and "\x1b" not in lines[0], lines[0]  # one plain line, not a paragraph
    for fragment in must_say:
        assert fragment in lines[0], lines[0]
    assert "s3cret" not in proc.stderr
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written


def test_monitor_config_that_expands_through_aliases_is_refused(tmp_path):
    from fp8track import ConfigError, MonitorConfig

    _files(tmp_path)
    with pytest.raises(ConfigError, match="more than 100,000 values"):
        MonitorConfig.load(tmp_path / "laughs-config.yaml")
    # anchors used a few times are fine
    from fp8track.errors import read_yaml_mapping

    (tmp_path / "small.yaml").write_text("a: &t [activation, weight]\nb: *t\n")
    assert read_yaml_mapping(tmp_path / "small.yaml", "x") == {"a": ["activation", "weight"]} | {
        "b": ["activation", "weight"]
    }


def test_error_messages_show_a_huge_value_bounded():
    from fp8track.errors import invalid_choice

    value = ["lol"] * 9
    for _ in range(8):
        value = [value] * 9  # 9^9 strings, shared: repr() alone would exhaust memory
    message = str(invalid_choice("method", value, ("grid", "random"), where="sweep file s.yaml"))
    assert len(message) < 300 and message.startswith("sweep file s.yaml: unknown method [[")
