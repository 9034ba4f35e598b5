"""Grouped GEMMs of mixture-of-experts layers in emulated FP8, one quantizer per expert.

Transformer Engine's ``GroupedLinear`` runs one GEMM per expert with one quantizer each
(``transformer_engine/pytorch/module/grouped_linear.py``: ``num_gemms`` input, weight and
grad-output quantizers), so every expert gets its own scale per tensor kind:

* current scaling: ``M / amax_e / 2**margin`` from expert ``e``'s own rows (its routed tokens),
  its own weight slice and its own dY rows;
* delayed scaling: one amax history per expert per tensor kind (:class:`DelayedScaler` with
  ``shape=(E,)``), updated after each training forward / backward as TE does.

:class:`FP8GroupedLinearFn` is the autograd Function: forward ``y_s = x_s W_e^T`` for the rows
``s`` of expert ``e`` (rows sorted by expert, ``offs`` the cumulative row counts, as
``torch._grouped_mm`` takes them), backward ``dgrad = dY W_e`` and ``wgrad_e = dY_e^T x_e`` from
the quantised operands. GEMMs run as ``torch._grouped_mm`` on the FP8 operands' values in float32
(a product of two FP8 numbers is exact in float32, as in the emulated linear), the scales' inverses
applied per row / per expert to the accumulator. ``torch._scaled_grouped_mm`` would take the FP8
operands directly but runs on CUDA only (torch 2.13); the result is the same up to summation order.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from fp8track.execution.checkpointing import ForwardScales, RecomputeQueue
from fp8track.execution.recipes import Recipe
from fp8track.numerics.formats import fp8_to_float32
from fp8track.numerics.scaling import BLOCK_SCALINGS, DelayedScaler, current_scale, dequantize, quantize

GROUPED_SCALINGS = ("delayed", "current", *BLOCK_SCALINGS)
"""Scalings the emulated grouped GEMM runs: per-expert tensor scales (here) and the block recipes
(:mod:`fp8track.execution.grouped_block`, groups padded along the tokens as TE and torchao pad them).
NVFP4's grouped GEMM is not emulated: the emulated backend lists such experts as unconverted."""

_ALIGN_BYTES = 16  # torch._grouped_mm: every stride but the last a multiple of 16 bytes


def _pad_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple - n


@torch.compiler.disable
def _eager_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a, b, offs=offs)


def _grouped_kernel(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm``; under ``torch.compile`` a non-BF16 call runs eagerly, outside the graph:
    torch 2.13's meta kernel accepts BF16 operands only (CPU eager also takes the float32 operands
    of the emulated FP8 GEMMs, whose FP8 products are exact in float32), so tracing it would fail."""
    if a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16:
        return torch._grouped_mm(a, b, offs=offs)
    return _eager_grouped_mm(a, b, offs)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offs)`` for any shapes.

    ``a [S, K]`` x ``b [E, K, N]`` -> ``[S, N]`` (rows of group ``e`` times ``b[e]``), or
    ``a [N, S]`` x ``b [S, K]`` -> ``[E, N, K]`` (groups along the contraction). The kernel wants
    strides in multiples of 16 bytes; zero padding of the contraction and output widths (and of the
    grouped contraction's tail) gives exactly the same products, so odd model widths work too.
    """
    mult = max(1, _ALIGN_BYTES // a.element_size())
    if b.dim() == 3:
        k, n = a.shape[1], b.shape[2]
        pk, pn = _pad_to(k, mult), _pad_to(n, mult)
        a_p = F.pad(a, (0, pk)).contiguous()
        b_p = F.pad(b, (0, pn, 0, pk)).contiguous()
        out = _grouped_kernel(a_p, b_p, offs)
        return out[:, :n] if pn else out
    s, k = b.shape
    ps, pk = _pad_to(s, mult), _pad_to(k, mult)
    a_p = F.pad(a, (0, ps)).contiguous()
    b_p = F.pad(b, (0, pk, 0, ps)).contiguous()
    out = _grouped_kernel(a_p, b_p, offs)
    return out[..., :k] if pk else out


def segment_ids(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """The group index of each of ``rows`` rows (int64, on ``offs``' device, no host sync);
    rows past ``offs[-1]`` get the index ``len(offs)``."""
    return torch.searchsorted(offs.to(torch.int64), torch.arange(rows, device=offs.device), right=True)


def segment_amax(x2d: torch.Tensor, seg: torch.Tensor, groups: int) -> torch.Tensor:
    """``max |x|`` over the rows of each group (float32 ``[groups]``; 0 for an empty group; NaN
    elements skipped and inf kept, as :func:`fp8track.numerics.scaling.amax` and TE's ``fmaxf``
    kernels), one pass, no host sync."""
    a = x2d.detach().abs().nan_to_num_(0.0, math.inf)  # in place on abs's copy: no second temporary
    row = a.amax(dim=1).to(torch.float32) if x2d.shape[1] else x2d.new_zeros(x2d.shape[0])
    out = torch.zeros(groups + 1, dtype=torch.float32, device=x2d.device)
    out = out.scatter_reduce(0, seg, row.to(torch.float32), reduce="amax", include_self=True)
    return out[:groups]


class GroupQuantizers:
    """Per-expert scales of one grouped projection under a per-tensor recipe (see the module docstring)."""

    def __init__(self, recipe: Recipe, num_experts: int) -> None:
        self.recipe = recipe
        self.num_experts = num_experts
        self.fmt = {k: recipe.formats.for_tensor(k) for k in ("activation", "weight", "gradient")}
        self.delayed: dict[str, DelayedScaler] = {}
        if recipe.scaling == "delayed":
            self.delayed = {
                k: DelayedScaler(f, recipe.amax_history_len, recipe.amax_compute_algo, recipe.margin,
                                 shape=(num_experts,))
                for k, f in self.fmt.items()
            }
        self._recompute = RecomputeQueue()
        self.last_scales: dict[str, torch.Tensor] = {}

    def begin_forward(self, update: bool) -> tuple[ForwardScales | None, bool]:
        """``(record, replay)``: a training forward inside backward while an earlier forward waits
        for its backward is its recompute and replays that forward's scales (as
        :class:`~fp8track.execution.emulated_linear.EmulatedFP8Linear` and TE do)."""
        if not (self.delayed and update):
            return None, False
        return self._recompute.begin_forward()

    def end_backward(self, rec: ForwardScales | None) -> None:
        self._recompute.end_backward(rec)

    def scales(
        self,
        kind: str,
        amax_e: torch.Tensor,
        update: bool,
        rec: tuple[ForwardScales | None, bool] = (None, False),
    ) -> torch.Tensor:
        """The ``[E]`` float32 scales tensor kind ``kind`` is quantised with now, given each
        expert's amax of it (delayed scaling records the amaxes and updates after choosing)."""
        if not self.delayed:
            s = current_scale(amax_e, self.fmt[kind], self.recipe.margin)
        else:
            record, replay = rec
            scaler = self.delayed[kind]
            scaler._to(amax_e.device)
            if replay and record is not None and kind in record.scales:
                s = record.scales[kind]
            else:
                s = scaler.scale.clone()
                if update:
                    scaler.observe(amax_e)
                    scaler.update()
                    if record is not None:
                        record.scales[kind] = s
        self.last_scales[kind] = s
        return s

    def state_dict(self) -> dict[str, Any]:
        return {k: s.state_dict() for k, s in self.delayed.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, s in (state or {}).items():
            if k in self.delayed:
                self.delayed[k].load_state_dict(s)


class FP8GroupedLinearFn(torch.autograd.Function):
    """``y = x W_e^T`` per expert group in emulated FP8 (see the module docstring)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, quant: GroupQuantizers,
        out_dtype: torch.dtype, update: bool,
    ) -> torch.Tensor:
        """``x [S, K]`` rows sorted by expert, ``weight [E, N, K]`` (GEMM orientation), ``offs [E]``."""
        e = weight.shape[0]
        seg = segment_ids(offs, x.shape[0])
        rec = quant.begin_forward(update)
        update = update and not rec[1]
        sx = quant.scales("activation", segment_amax(x, seg, e), update, rec)
        w_amax = weight.detach().abs().reshape(e, -1).amax(dim=1).to(torch.float32) if weight.numel() else \
            torch.zeros(e, dtype=torch.float32, device=weight.device)
        sw = quant.scales("weight", w_amax, update, rec)
        sx_rows = _gather(sx, seg)
        qx = quantize(x, quant.fmt["activation"], sx_rows.unsqueeze(1))
        qw = quantize(weight, quant.fmt["weight"], sw.view(e, 1, 1))
        out = _gemm(quant.recipe, qx, sx_rows.unsqueeze(1), qw, sw.view(e, 1, 1), offs, transpose_b=True)
        out = out * _gather(sw, seg).reciprocal().unsqueeze(1) if quant.recipe.gemm_mode == "fp8" else out
        ctx.save_for_backward(qx, qw, sx, sw, offs, seg)
        ctx.quant, ctx.update, ctx.record = quant, update, (rec[0] if not rec[1] else None)
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        return out.to(out_dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        qx, qw, sx, sw, offs, seg = ctx.saved_tensors
        quant: GroupQuantizers = ctx.quant
        e = qw.shape[0]
        g = grad_out.to(torch.float32)
        sg = quant.scales("gradient", segment_amax(g, seg, e), ctx.update)
        quant.end_backward(ctx.record)
        sg_rows = _gather(sg, seg).unsqueeze(1)
        qg = quantize(g, quant.fmt["gradient"], sg_rows)
        fp8 = quant.recipe.gemm_mode == "fp8"
        # dgrad: dY_s W_e (reduction over N), scaled back per row.
        grad_x = _gemm(quant.recipe, qg, sg_rows, qw, sw.view(e, 1, 1), offs, transpose_b=False)
        if fp8:
            grad_x = grad_x * _gather(sw, seg).reciprocal().unsqueeze(1)
        # wgrad: dY_e^T x_e (reduction over expert e's rows).
        if fp8:
            grad_w = grouped_mm(fp8_to_float32(qg).t(), fp8_to_float32(qx), offs)
            grad_w = grad_w * (sg * sx).reciprocal().view(e, 1, 1)
        else:
            gd = dequantize(qg, sg_rows, torch.bfloat16)
            xd = dequantize(qx, _gather(sx, seg).unsqueeze(1), torch.bfloat16)
            grad_w = grouped_mm(gd.t(), xd, offs).to(torch.float32)
        return grad_x.to(ctx.x_dtype), grad_w.to(ctx.w_dtype), None, None, None, None


def _gather(per_expert: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
    """Per-row values of per-expert ``[E]`` values (rows past the last group take 1)."""
    padded = torch.cat([per_expert, per_expert.new_ones(1)])
    return padded[seg]


def _gemm(
    recipe: Recipe, qa: torch.Tensor, sa_rows: torch.Tensor, qb: torch.Tensor, sb: torch.Tensor,
    offs: torch.Tensor, transpose_b: bool,
) -> torch.Tensor:
    """The grouped GEMM of FP8 ``qa [S, *]`` (row scales ``sa_rows``) and ``qb [E, *, *]``: under
    ``gemm="fp8"`` the FP8 values' product in float32 divided by ``sa`` (the caller divides by
    ``sb`` per row); under ``gemm="bf16"`` both operands dequantised to BF16 ("FP8 input, BF16 GEMM")."""
    if recipe.gemm_mode == "fp8":
        b = fp8_to_float32(qb)
        out = grouped_mm(fp8_to_float32(qa), b.transpose(-2, -1) if transpose_b else b, offs)
        return out * sa_rows.reciprocal()
    a = dequantize(qa, sa_rows, torch.bfloat16)
    b = dequantize(qb, sb, torch.bfloat16)
    return grouped_mm(a, b.transpose(-2, -1) if transpose_b else b, offs).to(torch.float32)


def fp8_grouped_linear(
    x: torch.Tensor, weight_oi: torch.Tensor, offs: torch.Tensor, quant: GroupQuantizers | None,
    training: bool,
) -> torch.Tensor:
    """``x W_e^T`` per group, in FP8 when ``quant`` is given (else the plain grouped GEMM in the
    weight's dtype, as Hugging Face's ``grouped_mm`` runs it)."""
    if quant is None:
        return grouped_mm(x.to(weight_oi.dtype), weight_oi.transpose(-2, -1), offs)
    update = training and torch.is_grad_enabled()
    with torch.autocast(x.device.type, enabled=False):
        return FP8GroupedLinearFn.apply(x, weight_oi, offs, quant, output_dtype(x), update)


def output_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype an FP8 GEMM returns for input ``x``: autocast's dtype when autocast is on, else
    ``x``'s (float32 for any other dtype)."""
    dev = x.device.type
    out = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    return out if out in (torch.float32, torch.bfloat16, torch.float16) else torch.float32


def equal_offsets(groups: int, rows_per_group: int, device: torch.device) -> torch.Tensor:
    """``offs`` of ``groups`` groups of ``rows_per_group`` rows each (Llama 4's dense experts)."""
    return torch.arange(1, groups + 1, device=device, dtype=torch.int32) * rows_per_group


__all__ = [
    "GROUPED_SCALINGS",
    "FP8GroupedLinearFn",
    "GroupQuantizers",
    "equal_offsets",
    "fp8_grouped_linear",
    "grouped_mm",
    "output_dtype",
    "segment_amax",
    "segment_ids",
]
