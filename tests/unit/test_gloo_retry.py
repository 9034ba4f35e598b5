"""The test kit's one retry of a distributed worker program that gloo aborted (see
``helpers.subprocesses.run_gloo_program``): only that abort is retried, on an emptied folder."""

import sys

import pytest

from helpers.subprocesses import GLOO_THREAD_ABORT, run_gloo_program

# Writes "try<N>" into its folder (N counted in a file beside it), fails the first time (every
# time if asked) with the message FIRST, else succeeds.
PROGRAM = """
import pathlib, sys
out, how = pathlib.Path(sys.argv[1]), sys.argv[2]
count = out.parent / "tries"
tries = int(count.read_text()) if count.exists() else 0
count.write_text(str(tries + 1))
(out / f"try{tries}").write_text("")
if tries == 0 or how == "always":
    sys.stderr.write(FIRST)
    sys.exit(134)
"""


def _run(tmp_path, first: str, how: str = "once"):
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "program.py"
    script.write_text(PROGRAM.replace("FIRST", repr(first)))
    return run_gloo_program([sys.executable, str(script), str(out), how], out, timeout=60), out


def test_a_gloo_abort_runs_the_program_once_more_in_an_emptied_folder(tmp_path):
    with pytest.warns(UserWarning, match="gloo aborted a worker"):
        proc, out = _run(tmp_path, GLOO_THREAD_ABORT)
    assert proc.returncode == 0
    assert sorted(p.name for p in out.iterdir()) == ["try1"]  # the first try's file was removed


def test_a_second_abort_and_any_other_failure_are_returned(tmp_path):
    with pytest.warns(UserWarning):
        proc, _ = _run(tmp_path, GLOO_THREAD_ABORT, how="always")
    assert proc.returncode == 134
    for i, first in enumerate(("Traceback (most recent call last):\n" + GLOO_THREAD_ABORT, "ValueError")):
        (tmp_path / str(i)).mkdir()
        proc, out = _run(tmp_path / str(i), first)
        assert proc.returncode == 134
        assert sorted(p.name for p in out.iterdir()) == ["try0"]
