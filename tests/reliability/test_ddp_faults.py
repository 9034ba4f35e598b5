"""Guarantee 3: a rank that raises, dies or hangs never leaves the others waiting forever in an
fp8track collective: they stop after ``collective_timeout_s`` at most with a clear
:class:`~fp8track.errors.RankFailure`, and only rank 0 has written. 2 gloo processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fp8track.monitoring.records import RunReader

SCRIPT = Path(__file__).parent / "scripts" / "ddp_fault.py"


def _run_pair(tmp_path, mode):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), str(tmp_path), str(rank), mode],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in (0, 1)
    ]  # fmt: skip
    try:
        out0, _ = procs[0].communicate(timeout=240)  # far below gloo's own 30-minute default
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[0].returncode == 3, out0[-3000:]
    return json.loads((tmp_path / "rank0.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["raise", "hang"])
def test_other_rank_stops_with_a_clear_error_within_the_timeout(tmp_path, mode):
    result = _run_pair(tmp_path, mode)
    assert result["done"] == [0, 1, 2]  # the steps both ranks finished
    error = result["error"]
    assert error["type"] == "RankFailure"
    assert "rank 0 gave up on the logging step's all-reduce" in error["message"]
    assert "another rank failed, died or stopped answering" in error["message"]
    assert error["waited_s"] < 5.0 + 30.0  # the configured bound (plus slack for a loaded machine)
    # Rank 0 alone wrote, and what it wrote covers the finished steps.
    (meta,) = list(tmp_path.rglob("meta.json"))
    assert sorted(RunReader(meta.parent).series("fp8/loss")) == [0, 1, 2]


@pytest.mark.slow
def test_tensor_parallel_amax_all_reduce_is_bounded_too(tmp_path):
    """Under tensor parallelism the shards share one scale: the weight's amax is MAX-reduced inside
    the forward hook. A peer that hangs there stops rank 0 with RankFailure after the timeout."""
    result = _run_pair(tmp_path, "tp_hang")
    assert result["done"] == [0, 1, 2]
    error = result["error"]
    assert error["type"] == "RankFailure"
    assert "rank 0 gave up on the tensor-parallel amax all-reduce" in error["message"]
    assert 5.0 <= error["waited_s"] < 5.0 + 30.0
