"""On a GPU the monitor's hooks never wait for the device, and a logging step copies to the host once.

`make test-gpu`; skipped without CUDA. Uses plain linears (no Transformer Engine needed) so that
every synchronisation CUDA's sync debug mode sees comes from fp8track.
"""

import warnings

import pytest
import torch
from torch import nn

from fp8track import Monitor, MonitorConfig
from fp8track.numerics import stats

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 2048), nn.GELU(), nn.Linear(2048, 1024)).cuda().to(torch.bfloat16)


def test_hooks_never_sync_and_a_logging_step_copies_once(tmp_path):
    model = _model()
    mon = Monitor(model, MonitorConfig(every_n_steps=2, whatif=("current",)), log_dir=tmp_path).attach()
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    # Warm-up: compile the kernels (compilation itself may synchronise).
    for _ in range(2):
        model(x).float().square().mean().backward()
        mon.step(loss=None)
    syncs = {}
    for step in range(4):  # sampled, unsampled, sampled, unsampled
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss = model(x).float().square().mean()
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                mon.step(loss=loss)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs[step] = sum("synchroniz" in str(w.message) for w in caught)
    mon.close()
    assert syncs == {0: 1, 1: 0, 2: 1, 3: 0}


def test_statistics_kernel_is_compiled_for_cuda_and_matches_eager():
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    try:
        stats.set_compile("compiled")
        c = stats.partial_stats(x, "e4m3")
        assert (
            stats._POLICY.kernels.get(("cuda", stats.row_length(x.numel(), "cuda"))) is not None
            and not stats._POLICY.failed
        )
        stats.set_compile("eager")
        e = stats.partial_stats(x, "e4m3")
    finally:
        stats.set_compile("auto")
    assert c.device.type == "cuda"
    assert torch.equal(c[:5], e[:5])
    assert torch.allclose(c, e, rtol=1e-6)


def test_grouped_pass_matches_per_tensor_partials_on_cuda_without_syncs():
    """The batch's grouped pass (every tensor of a hook phase in one set of launches) gives each
    tensor's eager partial on the device (counts and maxima exact, sums to float64 rounding; the
    float64 atomics of index_add order them differently) and, its layout cached, never waits."""
    from fp8track.numerics.segment_stats import tensors_partial_stats

    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = ((16, 16), (64, 1024), (333,))
    xs = [torch.randn(s, device="cuda", generator=g, dtype=torch.bfloat16) for s in shapes]
    scales = [None, torch.tensor(4.0, device="cuda"), None]
    tensors_partial_stats(xs, "e4m3", scales)  # the layout's host-to-device copy, once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = tensors_partial_stats(xs, "e4m3", scales)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    mode = stats.get_compile()
    stats.set_compile("eager")
    try:
        for x, s, row in zip(xs, scales, out, strict=True):
            ref = stats.partial_stats(x, "e4m3", s)
            assert torch.equal(row[:5], ref[:5]) and torch.equal(row[9:], ref[9:])
            torch.testing.assert_close(row[5:9], ref[5:9], rtol=1e-13, atol=0)
    finally:
        stats.set_compile(mode)
