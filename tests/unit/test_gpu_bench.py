"""bench/gpu_bench.py: a clean skip without CUDA, and a dry run of its code paths on CPU tensors."""

from __future__ import annotations

import json

import pytest
import torch

from fp8track.numerics import stats


@pytest.fixture(scope="module")
def gpu_bench():
    import gpu_bench  # bench/, on pytest's pythonpath

    return gpu_bench


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_without_cuda_it_prints_skipped_and_exits_0(gpu_bench, capsys):
    assert gpu_bench.main([]) == 0
    assert json.loads(capsys.readouterr().out) == {"skipped": "no CUDA"}


def test_dry_run_exercises_every_section_on_cpu(gpu_bench):
    stats.set_compile("eager")  # the compiled kernel has its own tests; keep this one fast
    try:
        out = gpu_bench.run(torch.device("cpu"), dry_run=True)
    finally:
        stats.set_compile("auto")
    assert "errors" not in out, out.get("errors")
    row = out["stats_vs_amax"]["64x1024_bf16"]
    assert row["amax_pass_ms"] > 0 and row["ratio"] == pytest.approx(
        row["partial_stats_ms"] / row["amax_pass_ms"], rel=1e-2
    )
    mon = out["monitor"]
    assert mon["backend"] == "torchao"  # TE needs CUDA: the fallback the GPU run takes without TE
    assert set(mon) >= {"none", "every_2", "every_1", "sync"}
    # Each configuration ran every step of every round; the baseline's ratio is 1 by definition.
    assert all(mon[k]["steps"] == 4 for k in ("none", "every_2", "every_1"))
    assert mon["none"]["mean_ratio"] == 1.0
    assert mon["sync"] == {"checked": False, "reason": "needs CUDA's sync debug mode"}
    assert out["te_debug"] == {"skipped": "needs CUDA and Transformer Engine"}


def test_sync_counter_is_inert_on_cpu(gpu_bench):
    counter = [0]
    with gpu_bench._count_syncs(torch.device("cpu"), counter):
        torch.ones(3).sum().item()
    assert counter == [0]
