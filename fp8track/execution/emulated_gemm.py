"""The emulated FP8 backend's GEMMs and per-tensor scale choice
(:class:`~fp8track.execution.emulated_linear.EmulatedFP8Linear` runs them).

Scales (all from :mod:`fp8track.numerics.scaling`):

* ``delayed``: one :class:`~fp8track.numerics.scaling.DelayedScaler` per tensor kind. Each training
  forward quantises with the current scale, records the amax, recomputes the scale from the
  history (``max`` or ``most_recent``, margin) and rolls the history, as TE does when the
  outermost autocast exits; the gradient scaler updates in backward. In eval mode (or under
  ``no_grad``) the scales are used but not updated. An activation-checkpointing recompute
  replays the scales of the forward it repeats and updates nothing, as TE does
  (:mod:`fp8track.execution.checkpointing`). The histories travel in ``state_dict``
  (``_extra_state``, like TE).
* ``current`` / ``fp8_input_bf16_gemm``: ``FP8_MAX / amax(x) / 2**margin`` per tensor.

GEMM modes:

* ``fp8``: per-tensor recipes call ``torch._scaled_mm`` (FP8 x FP8, float32 accumulation,
  ``scale_inv`` applied to the accumulator) on CUDA. On CPU the same product is formed as a
  float32 matmul of the FP8 operands' values (each product of two FP8 numbers is exact in
  float32) with ``scale_inv`` applied to the accumulator: identical up to summation order, and
  about 300x faster than CPU ``_scaled_mm`` in torch 2.13 (1.6 s for a 1024x64x256 GEMM). When an operand
  dimension is not a multiple of 16 (what the CUDA kernel demands) the same quantised operands
  are dequantised to float32 and multiplied there instead: identical inputs, float32 accumulation.
  Block-scaled recipes always use that dequantised path (``_scaled_mm`` has no block scales on
  CPU); dequantised block operands are exact in BF16 because their scales are powers of two.
* ``bf16``: operands quantised, dequantised to BF16, BF16 matmul ("FP8 input, BF16 GEMM").
"""

from __future__ import annotations

import torch

from fp8track.execution.checkpointing import ForwardScales, RecomputeQueue
from fp8track.execution.recipes import Recipe
from fp8track.numerics.formats import fp8_to_float32
from fp8track.numerics.scaling import DelayedScaler, amax, current_scale, dequantize, quantize


def _fits_scaled_mm(a: torch.Tensor, b: torch.Tensor) -> bool:
    # cuBLASLt FP8 GEMMs need both inner and outer dims in multiples of 16.
    return a.shape[1] % 16 == 0 and b.shape[1] % 16 == 0 and a.shape[0] % 16 == 0


def _fp8_values_mm(a: torch.Tensor, sa: torch.Tensor, b_t: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    """What ``_scaled_mm`` computes, in float32: exact FP8 x FP8 products, float32 accumulation,
    ``scale_inv`` of both operands applied to the accumulator."""
    return (fp8_to_float32(a) @ fp8_to_float32(b_t).t()) * (sa * sb).reciprocal()


def fp8_mm(
    a: torch.Tensor, sa: torch.Tensor, b_t: torch.Tensor, sb: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``(a / sa) @ (b_t / sb)^T`` from FP8 ``a`` [M, K] and ``b_t`` [N, K] with per-tensor scales."""
    if a.device.type == "cpu":
        return _fp8_values_mm(a, sa, b_t, sb).to(out_dtype)
    if _fits_scaled_mm(a, b_t):
        # _scaled_mm wants a row-major and b column-major; b_t.t() of a contiguous [N, K] is that.
        return torch._scaled_mm(
            a.contiguous(),
            b_t.contiguous().t(),
            scale_a=sa.reciprocal(),
            scale_b=sb.reciprocal(),
            out_dtype=out_dtype,
        )
    return (dequantize(a, sa) @ dequantize(b_t, sb).t()).to(out_dtype)


def bf16_mm(a_deq: torch.Tensor, b_t_deq: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return (a_deq.to(torch.bfloat16) @ b_t_deq.to(torch.bfloat16).t()).to(out_dtype)


class Quantizers:
    """Per-tensor scale choice for one layer: delayed scalers or current scaling."""

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe
        fmts = recipe.formats
        self.fmt = {k: fmts.for_tensor(k) for k in ("activation", "weight", "gradient")}
        self.delayed: dict[str, DelayedScaler] = {}
        if recipe.scaling == "delayed":
            self.delayed = {
                k: DelayedScaler(f, recipe.amax_history_len, recipe.amax_compute_algo, recipe.margin)
                for k, f in self.fmt.items()
            }
        # Delayed scaling: training forwards whose backward has not run yet, oldest first (weak:
        # a graph dropped without a backward takes its entry with it).
        self._recompute = RecomputeQueue()

    def begin_forward(self, update: bool) -> tuple[ForwardScales | None, bool]:
        """``(record, replay)`` for a forward of this layer under delayed scaling.

        A training forward inside a backward pass while an earlier forward is still waiting for
        its backward is that forward's activation-checkpointing recompute: it replays the oldest
        such forward's scales (first in, first out, as TE's ``fp8_tensors_recompute_buffer``) and
        updates nothing (``replay`` True). Any other training forward gets a fresh record to fill.
        See :mod:`fp8track.execution.checkpointing`.
        """
        if not (self.delayed and update):
            return None, False
        return self._recompute.begin_forward()

    def end_backward(self, rec: ForwardScales | None) -> None:
        """The backward of the forward that filled ``rec`` ran: it waits no more."""
        self._recompute.end_backward(rec)

    def quantize(
        self,
        kind: str,
        x: torch.Tensor,
        update: bool,
        rec: tuple[ForwardScales | None, bool] = (None, False),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(fp8 tensor, scale used)`` for one tensor of kind ``kind``.

        ``rec`` comes from :meth:`begin_forward`."""
        if self.delayed:
            scaler = self.delayed[kind]
            record, replay = rec
            if replay and record is not None and kind in record.scales:
                s = record.scales[kind]
                return quantize(x, self.fmt[kind], s), s
            if update:
                q, s = scaler.quantize(x)
                if record is not None:
                    record.scales[kind] = s
                return q, s
            scaler._to(x.device)
            return quantize(x, self.fmt[kind], scaler.scale), scaler.scale.clone()
        s = current_scale(amax(x), self.fmt[kind], self.recipe.margin)
        return quantize(x, self.fmt[kind], s), s
