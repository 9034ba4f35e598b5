"""DDP with 2 CPU processes (gloo): one run directory, statistics reduced over both ranks' data."""

import sys
from pathlib import Path

import pytest
import torch

from fp8track.monitoring.records import RunReader
from fp8track.numerics.nvfp4 import max_blockwise_dynamic_range
from fp8track.numerics.stats import finalize, merge_partials, partial_stats

from helpers.dist_sizes import DDP_BATCH, DDP_D_IN
from helpers.subprocesses import python_env, run_gloo_program

SCRIPT = Path(__file__).parent / "scripts" / "ddp_monitor.py"


@pytest.mark.slow
def test_ddp_two_ranks_reduce_to_single_process_statistics(tmp_path):
    env = python_env(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = run_gloo_program([sys.executable, str(SCRIPT), str(tmp_path)], tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dirs = [p.parent for p in tmp_path.rglob("meta.json")]
    assert len(run_dirs) == 1, f"expected one run directory (rank 0 only), got {run_dirs}"
    reader = RunReader(run_dirs[0])
    all_rows = list(reader.tensor_stats())
    rows = {(r.step, r.layer, r.tensor): r.stats for r in all_rows if r.variant == "shadow"}
    assert {s for s, _, _ in rows} == {0, 3}

    # Step 0: the first layer's input is the raw batch each rank saw (saved by the script). The
    # logged statistic must equal one computed over both ranks' rows together.
    rank_batches = [torch.load(tmp_path / f"rank{r}_step0_input.pt") for r in range(2)]
    assert not torch.equal(rank_batches[0], rank_batches[1])
    expected = finalize(merge_partials([partial_stats(b, "e4m3") for b in rank_batches]), "e4m3")
    got = rows[(0, "net.0", "activation")]
    assert got["numel"] == 2 * DDP_BATCH * DDP_D_IN
    for k in ("amax", "amin", "underflow_pct", "overflow_pct", "scale"):  # counts and extrema: exact
        assert got[k] == expected[k], k
    # Sums may be accumulated in another order in another process (compiled kernel vs the eager
    # fallback, e.g. when two ranks race on a cold inductor cache): float rounding only.
    for k in ("mse", "cos", "sqnr_db"):
        assert got[k] == pytest.approx(expected[k], rel=1e-6), k
    # The same union as one tensor: scales differ per rank (current scaling), so it is not equal
    # in general, but amax/amin/numel are order-free and must agree exactly.
    whole = torch.cat(rank_batches)
    assert got["amax"] == pytest.approx(whole.abs().max().item())
    assert got["amin"] == pytest.approx(whole.abs()[whole != 0].min().item())
    # A block row's max_blockwise_dynamic_range (TE's LogTensorStats) is the larger of the ranks'
    # (the MAX collective): MXFP8 1x32 blocks, both orientations for activations, per rank.
    mx = {(r.step, r.layer, r.tensor): r.stats for r in all_rows if r.variant == "mxfp8"}
    want = max(max_blockwise_dynamic_range(b, 32, 1, max_over_orientations=True) for b in rank_batches)
    assert mx[(0, "net.0", "activation")]["max_blockwise_dynamic_range"] == pytest.approx(want, rel=1e-6)
    assert "max_blockwise_dynamic_range" not in got
    # The loss series is the mean over ranks and covers every step.
    assert sorted(reader.series("fp8/loss")) == list(range(6))
