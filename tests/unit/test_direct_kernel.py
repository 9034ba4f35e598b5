"""The compiled statistics kernel called without Dynamo on CPU (``kernel_policy._build_direct``):
the same numbers as ``torch.compile`` of the same kernel, bit for bit, one build per input layout
whatever the number of rows, and ``torch.compile`` again wherever a build fails."""

import math
import warnings

import pytest
import torch

from fp8track.numerics import kernel_policy, stats
from fp8track.numerics.stats import partial_stats


def _cases() -> list[torch.Tensor]:
    """Tensors of 2 to 70 rows of 1024, with and without a padded tail, and the values that take
    special paths: zeros, infinities, NaN, float32 subnormals, a range wider than FP8's."""
    gen = torch.Generator().manual_seed(5)
    out = []
    for n in (2 * 1024, 5 * 1024 + 3, 64 * 1024, 70 * 1024 + 1000):
        x = torch.randn(n, generator=gen) * torch.logspace(-6, 6, n)
        x[::31] = 0.0
        x[7], x[8], x[9], x[10] = math.inf, -math.inf, math.nan, 1e-42
        out.append(x)
    return out


@pytest.fixture
def compiled_policy(monkeypatch):
    """The ``"compiled"`` policy with fresh kernel caches (restored after)."""
    monkeypatch.setattr(stats._POLICY, "direct", {})
    monkeypatch.setattr(stats._POLICY, "kernels", {})
    stats.set_compile("compiled")
    yield monkeypatch
    stats.set_compile("auto")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_direct_kernel_equals_torch_compile_bit_for_bit(compiled_policy, dtype):
    cases = [x.to(dtype) for x in _cases()]
    scalings = (("e4m3", None), ("e5m2", 0.01), ("e4m3", 3.7))
    direct = [partial_stats(x, fmt, scale) for x in cases for fmt, scale in scalings]
    # Two layouts (with and without a tail), each built once and called for every row count.
    assert {key[1][1:] for key in stats._POLICY.direct} == {(dtype, (1024,))}
    assert len(stats._POLICY.direct) == 2 and all(stats._POLICY.direct.values())
    assert stats._POLICY.kernels == {}  # torch.compile was not asked
    compiled_policy.setattr(kernel_policy, "DIRECT_DEVICES", ())
    dynamo = [partial_stats(x, fmt, scale) for x in cases for fmt, scale in scalings]
    assert stats._POLICY.kernels  # now it was
    for got, want in zip(direct, dynamo, strict=True):
        assert torch.equal(got, want)


def test_a_failed_build_warns_and_torch_compile_serves_that_layout(compiled_policy):
    def refuse(*args, **kwargs):
        raise RuntimeError("inductor refuses")

    compiled_policy.setattr(torch._inductor, "standalone_compile", refuse)
    x = _cases()[1]
    with pytest.warns(UserWarning, match="direct build of the statistics kernel failed"):
        got = partial_stats(x, "e4m3")
    assert list(stats._POLICY.direct.values()) == [None]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = partial_stats(x, "e4m3")  # no second build, no second warning
    assert torch.equal(again, got)
    stats.set_compile("eager")
    want = partial_stats(x, "e4m3")
    assert torch.equal(got[:5], want[:5])  # counts exactly (torch.compile's float32 row sums:
    assert torch.allclose(got[5:9], want[5:9], rtol=1e-6, atol=0)  # the sums to rounding)
    assert torch.equal(got[9:], want[9:])


def test_a_thread_count_gets_its_own_build():
    """Inductor's C++ kernel fixes its OpenMP team when compiled: a graph built under one thread
    count is not called under another."""
    main, tail = torch.zeros(4, 1024), torch.zeros(1, 1024)
    threads = torch.get_num_threads()
    keys = set()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            keys.add(kernel_policy._direct_key((main, tail)))
    finally:
        torch.set_num_threads(threads)
    assert len(keys) == 2
    assert kernel_policy._direct_key((main.t(), tail)) is None  # not contiguous: torch.compile
