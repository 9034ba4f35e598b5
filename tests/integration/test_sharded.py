"""Sharded training with CPU processes (gloo): FSDP2, tensor parallelism (column- and row-wise), both,
and Lightning's ModelParallelStrategy. Every logged statistic must equal the single-process
statistics of the same global tensors (gathered by the worker script, recomputed here)."""

import math
import sys
from pathlib import Path

import pytest
import torch

from fp8track.monitoring.records import RunReader
from fp8track.numerics.stats import STAT_NAMES, finalize, merge_partials, partial_stats

from helpers.dist_sizes import SHARDED_BATCH, SHARDED_LAYERS, SHARDED_STEPS
from helpers.subprocesses import python_env, run_gloo_program

SCRIPT = Path(__file__).parent / "scripts" / "sharded_monitor.py"

FORMATS = {"activation": "e4m3", "weight": "e4m3", "gradient": "e5m2"}  # shadow mode, hybrid pair


def _run(cmd: list[str], tmp_path: Path) -> None:
    env = python_env(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = run_gloo_program(cmd, tmp_path, env=env, timeout=400, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _torchrun(tmp_path: Path, modes: str, world: int) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
    _run([*cmd, str(SCRIPT), str(tmp_path), modes], tmp_path)


def _close(got: float, want: float, what: str) -> None:
    if math.isinf(want) or want == 0:
        assert got == want, what
    else:
        assert got == pytest.approx(want, rel=1e-6), what


def _check(tmp_path: Path, world: int, prefix: str = "") -> None:
    run_dirs = [p.parent for p in tmp_path.rglob("meta.json")]
    assert len(run_dirs) == 1, run_dirs
    reader = RunReader(run_dirs[0])
    rows = {(r.step, r.layer, r.tensor): r.stats for r in reader.tensor_stats()}
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    # One global tensor per data-parallel rank (its tensor-parallel ranks gathered the same one).
    by_dp = {}
    for r in ranks:
        by_dp.setdefault(r["dp_rank"], r["saved"])
    saved = ranks[0]["saved"]
    for step in range(SHARDED_STEPS):
        for layer in SHARDED_LAYERS:
            for tensor, fmt in FORMATS.items():
                if tensor == "weight":  # one weight, complete on every rank: counted once
                    for r in ranks:
                        assert torch.equal(r["saved"][(step, layer, tensor)], saved[(step, layer, tensor)])
                    parts = [partial_stats(saved[(step, layer, tensor)], fmt)]
                else:  # each data-parallel rank's tensor with its own scale, merged
                    parts = [partial_stats(s[(step, layer, tensor)], fmt) for s in by_dp.values()]
                want = finalize(merge_partials(parts), fmt)
                got = rows[(step, prefix + layer, tensor)]
                for stat in STAT_NAMES:
                    _close(got[stat], want[stat], f"step {step} {layer} {tensor} {stat}")
            w = saved[(step, layer, "weight")]
            assert rows[(step, prefix + layer, "weight")]["numel"] == w.numel()
            a = sum(s[(step, layer, "activation")].numel() for s in by_dp.values())
            assert (
                rows[(step, prefix + layer, "activation")]["numel"]
                == a
                == len(by_dp) * SHARDED_BATCH * w.shape[1]
            )
    grad_norm = reader.series("fp8/grad_norm")
    loss = reader.series("fp8/loss")
    for step in range(SHARDED_STEPS):
        _close(grad_norm[step], float(saved[(step, "grad_norm")]), f"grad_norm {step}")
        _close(loss[step], float(saved[(step, "loss")]), f"loss {step}")


# One process start per world size; the modes run one after the other in it. FSDP2 over all ranks
# (with 2 ranks also with torchao float8 and FP8 all-gather),
# tensor parallelism over all ranks on a (dp=1, tp=N) mesh, and with 4 ranks both on (dp=2, tp=2).
MODES = {2: ("fsdp", "fsdp_fp8", "tp"), 4: ("fsdp", "tp", "fsdp_tp")}


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(MODES))
def test_sharded_statistics_equal_single_process(tmp_path, world):
    _torchrun(tmp_path, ",".join(MODES[world]), world)
    for mode in MODES[world]:
        _check(tmp_path / mode, world)


@pytest.mark.slow
def test_lightning_model_parallel_strategy(tmp_path):
    _run([sys.executable, str(SCRIPT), str(tmp_path), "lightning", "2"], tmp_path)
    _check(tmp_path, 2)  # the LightningModule's `self.model` holder is not part of the recorded names
