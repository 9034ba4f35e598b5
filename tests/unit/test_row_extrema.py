"""The fused per-row extrema of the grouped statistics pass: the compiled graph equals the eager one
bit for bit (max and min are exact in any order), non-finite elements and zeros left out as the
statistics define them (amax over finite values, amin over finite non-zero values)."""

from __future__ import annotations

import math

import pytest
import torch

from fp8track.numerics.kernel_policy import compiled_row_extrema, get_compile, row_extrema, set_compile


@pytest.fixture
def mode():
    before = get_compile()
    yield set_compile
    set_compile(before)


def test_compiled_row_extrema_equal_eager_and_skip_nonfinite_and_zeros(mode):
    mode("compiled")
    g = torch.Generator().manual_seed(7)
    x = torch.randn(40, 96, generator=g) * torch.logspace(-30, 30, 40).unsqueeze(1)
    x[0] = 0.0  # all zeros: amax 0, amin inf
    x[1] = math.nan  # nothing finite: amax 0, amin inf
    x[2, :3] = torch.tensor([math.inf, -math.inf, math.nan])  # non-finite among finite values
    x[3] = -0.0
    x[4] = torch.tensor(1e-45).expand(96)  # float32's smallest subnormal
    x[5, 7] = -7.0
    x[5, 8] = 3.0
    x[5, 9:] = 0.5
    x[5, :7] = -1e-3
    fused = compiled_row_extrema(x)
    assert fused is not None  # the policy compiles this size
    eager = row_extrema(x)
    assert torch.equal(fused, eager)
    assert fused[0].tolist() == [0.0, math.inf] and fused[1].tolist() == [0.0, math.inf]
    assert fused[3].tolist() == [0.0, math.inf]
    assert fused[4].tolist() == [pytest.approx(1.4e-45, rel=0.01)] * 2
    assert fused[5].tolist() == [7.0, pytest.approx(1e-3, rel=1e-6)]
    finite = x[2, 3:].abs()
    assert fused[2].tolist() == [finite.max().item(), finite[finite > 0].min().item()]


def test_small_tensors_stay_eager(mode):
    mode("auto")
    assert compiled_row_extrema(torch.ones(4, 8)) is None  # below the policy's compile size
