"""The CPU FP8 GEMM of the emulated backend equals ``torch._scaled_mm`` (same FP8 operands, float32
accumulation, scale_inv on the accumulator) up to float32 summation order."""

from __future__ import annotations

import torch

from fp8track.execution.emulated_gemm import fp8_mm


def test_cpu_fp8_gemm_matches_scaled_mm() -> None:
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(32, 48, generator=g) * 3).to(torch.float8_e4m3fn)
    b_t = (torch.randn(16, 48, generator=g) * 2).to(torch.float8_e5m2)
    sa, sb = torch.tensor(3.7), torch.tensor(0.45)
    ref = torch._scaled_mm(
        a, b_t.t(), scale_a=sa.reciprocal(), scale_b=sb.reciprocal(), out_dtype=torch.float32
    )
    out = fp8_mm(a, sa, b_t, sb, torch.float32)
    # Independent float64 reference of the same formula.
    exact = (a.double() @ b_t.double().t()) / (3.7 * 0.45)
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=1e-5)
    torch.testing.assert_close(out.double(), exact, rtol=2e-6, atol=1e-5)
