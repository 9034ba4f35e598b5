"""Grouped GEMMs of mixture-of-experts layers under block-scaled recipes (MXFP8, 128-blocks), emulated.

Each operand is quantised along the reduction dimension of the GEMM that consumes it, with the
recipe's block layout (:func:`fp8track.numerics.scaling.block_layout`), as the emulated linear's
block path and Transformer Engine do:

* forward ``y_s = x_s W_e^T``: ``x`` row-wise (blocks along the hidden width, one row = one token,
  so no block mixes experts), each ``W_e`` along its input width (128-block recipes: 128 x 128
  tiles of each expert's own ``[out, in]`` slice, the out dimension zero-padded per expert so no
  tile straddles two experts);
* dgrad ``dx_s = dY_s W_e``: ``dY`` row-wise, ``W_e`` column-wise;
* wgrad ``dW_e = dY_e^T x_e``: ``dY`` and ``x`` column-wise, blocks along **one expert's** tokens.
  Each expert's rows are zero-padded to a multiple of the block first, as Transformer Engine pads
  ``m_splits`` (``Fp8Padding``, to ``get_align_size_for_quantization``: 32 for MXFP8) and torchao's
  MoE training pads token groups (32 for MXFP8): a zero changes no block's amax, and a block never
  holds two experts' tokens. A 128-block recipe quantises each group on its own, its last block
  partial, which the same padding reproduces.

The GEMMs multiply the dequantised operands in BF16 (an FP8 value times a power-of-two scale is
exact in BF16), as the emulated linear's block path does (``_bf16_mm``); ``torch._grouped_mm``
runs them on CPU and GPU alike.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from fp8track.execution.grouped import grouped_mm, output_dtype
from fp8track.execution.recipes import Recipe
from fp8track.numerics.formats import FP8Format
from fp8track.numerics.scaling import BLOCK_LAYOUTS, block_fake_quantize, block_layout

TENSORS = ("activation", "weight", "gradient")


def _fq(x2d: torch.Tensor, layout: str, fmt: FP8Format) -> torch.Tensor:
    return block_fake_quantize(x2d, layout, fmt)[0]


def expert_fake_quantize(w: torch.Tensor, layout: str, fmt: FP8Format) -> torch.Tensor:
    """Block fake quantisation of every expert's ``[R, C]`` slice of ``w [E, R, C]`` on its own
    (blocks along ``C``; tiles never cross experts: ``R`` is zero-padded per expert)."""
    e, r, c = w.shape
    size, tiles, _ = BLOCK_LAYOUTS[layout]
    pad = (-r) % size if tiles else 0
    wp = F.pad(w.to(torch.float32), (0, 0, 0, pad)) if pad else w.to(torch.float32)
    deq = _fq(wp.reshape(e * (r + pad), c), layout, fmt).reshape(e, r + pad, c)
    return deq[:, :r] if pad else deq


def padded_positions(offs: torch.Tensor, rows: int, multiple: int) -> tuple[torch.Tensor, int]:
    """Where each of ``rows`` rows (grouped by ``offs``) lands once every group is zero-padded to a
    multiple of ``multiple`` rows: ``(positions [rows] int64, padded row count)``.

    The count is an upper bound known without reading ``offs`` on the host (``rows`` plus a full
    block per group, rounded up); rows past ``offs[-1]`` form one more group at the end.
    """
    dev = offs.device
    ends = torch.cat([offs.to(torch.int64), torch.tensor([rows], dtype=torch.int64, device=dev)])
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (counts + multiple - 1) // multiple * multiple
    seg = torch.searchsorted(ends, torch.arange(rows, device=dev), right=True)
    starts, starts_p = ends - counts, torch.cumsum(padded, 0) - padded
    pos = starts_p[seg] + torch.arange(rows, device=dev) - starts[seg]
    total = -(-(rows + len(ends) * (multiple - 1)) // multiple) * multiple
    return pos, total


def columnwise_fake_quantize(
    x2d: torch.Tensor, pos: torch.Tensor, total: int, layout: str, fmt: FP8Format
) -> torch.Tensor:
    """The column-wise copy of ``x2d [S, C]`` (blocks along the rows of each group, groups padded
    as :func:`padded_positions` places them), dequantised, in ``x2d``'s row order (float32)."""
    buf = x2d.new_zeros(total, x2d.shape[1], dtype=torch.float32)
    buf[pos] = x2d.to(torch.float32)
    return _fq(buf.t(), layout, fmt).t()[pos]


def _bf16_grouped(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, out: torch.dtype) -> torch.Tensor:
    return grouped_mm(a.to(torch.bfloat16), b.to(torch.bfloat16), offs).to(out)


class FP8GroupedBlockFn(torch.autograd.Function):
    """``y = x W_e^T`` per expert group under a block recipe (see the module docstring)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, recipe: Recipe,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        """``x [S, K]`` rows sorted by expert, ``weight [E, N, K]`` (GEMM orientation), ``offs [E]``."""
        layout = {t: block_layout(recipe.scaling, t) for t in TENSORS}
        fwd = recipe.formats.forward
        xd = _fq(x, layout["activation"], fwd)
        wd = expert_fake_quantize(weight, layout["weight"], fwd)
        ctx.save_for_backward(x, weight, offs)
        ctx.recipe, ctx.layout = recipe, layout
        return _bf16_grouped(xd, wd.transpose(-2, -1), offs, out_dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, weight, offs = ctx.saved_tensors
        recipe: Recipe = ctx.recipe
        layout = ctx.layout
        fwd, bwd = recipe.formats.forward, recipe.formats.backward
        g_row = _fq(grad_out, layout["gradient"], bwd)
        w_col = expert_fake_quantize(weight.transpose(-2, -1), layout["weight"], fwd).transpose(-2, -1)
        grad_x = _bf16_grouped(g_row, w_col, offs, x.dtype)
        pos, total = padded_positions(offs, x.shape[0], BLOCK_LAYOUTS[layout["activation"]][0])
        g_col = columnwise_fake_quantize(grad_out, pos, total, layout["gradient"], bwd)
        x_col = columnwise_fake_quantize(x, pos, total, layout["activation"], fwd)
        grad_w = _bf16_grouped(g_col.t(), x_col, offs, torch.float32)
        return grad_x, grad_w.to(weight.dtype), None, None, None


def fp8_block_grouped_linear(
    x: torch.Tensor, weight_oi: torch.Tensor, offs: torch.Tensor, recipe: Recipe
) -> torch.Tensor:
    """``x W_e^T`` per group under block recipe ``recipe`` (``weight_oi [E, out, in]``)."""
    with torch.autocast(x.device.type, enabled=False):
        return FP8GroupedBlockFn.apply(x, weight_oi, offs, recipe, output_dtype(x))


__all__ = [
    "FP8GroupedBlockFn",
    "columnwise_fake_quantize",
    "expert_fake_quantize",
    "fp8_block_grouped_linear",
    "padded_positions",
]
