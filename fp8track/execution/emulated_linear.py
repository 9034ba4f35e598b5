"""CPU (and any-device) emulation of Transformer Engine's FP8 linear layer.

:class:`EmulatedFP8Linear` is an ``nn.Linear`` whose matmuls run through an autograd Function
that quantises exactly what TE quantises, with the recipe's formats and scales:

* forward GEMM ``y = x W^T``: activation ``x`` and weight ``W`` in the forward format;
* backward: ``dY`` in the backward format (E5M2 under ``hybrid``); ``dgrad = dY W`` and
  ``wgrad = dY^T x`` run from quantised operands. Per-tensor recipes reuse the forward FP8
  copies of ``x`` and ``W`` (one scale per tensor serves both orientations, as in TE); block
  recipes quantise each operand along the GEMM's reduction dimension, as TE's row-wise and
  column-wise copies do: MXFP8 1x32 blocks with E8M0 scales for every operand; ``block`` 1x128
  blocks for activation and gradient, 128x128 tiles for the weight, power-of-two scales.
* ``nvfp4`` (TE's ``NVFP4BlockScaling``, :mod:`fp8track.numerics.nvfp4`): activation 1x16 blocks,
  weight 16x16 tiles, dY 1x16 with stochastic rounding (a private seeded generator per layer);
  the wgrad operands column-wise with the 16x16 random Hadamard transform along the tokens;
  each switch off with ``no_rht`` / ``no_sr`` / ``no_2d``. GEMMs in float32 from the
  dequantised operands (what the FP4 tensor core accumulates, up to summation order).
* the bias gradient comes from the high-precision ``dY`` (TE's dbias does too).

Scales and GEMMs: :mod:`fp8track.execution.emulated_gemm` (delayed scalers per tensor kind or
current scaling; ``torch._scaled_mm`` or its float32 equivalent, or BF16 GEMMs of dequantised
operands).

The ``bf16`` recipe runs ``F.linear`` unchanged, so the control goes through the same module.
:class:`EmulatedFP8Conv1D` does the same for Hugging Face's ``Conv1D`` (GPT-2), whose weight is
stored ``[in, out]``: the same GEMMs on ``W^T``.
The output dtype is the autocast dtype when autocast is on, else the input's dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fp8track.execution.emulated_gemm import Quantizers, bf16_mm, fp8_mm
from fp8track.execution.layers import InOutWeightGemm
from fp8track.execution.recipes import Recipe
from fp8track.numerics.nvfp4 import NVFP4Recipe, new_generator, nvfp4_quantize
from fp8track.numerics.scaling import (
    BLOCK_SCALINGS,
    DelayedScaler,
    block_fake_quantize,
    block_layout,
    dequantize,
)

__all__ = ["SR_STATE_KEY", "EmulatedFP8Conv1D", "EmulatedFP8Layer", "EmulatedFP8Linear"]


class _EmulatedFP8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: EmulatedFP8Layer, out_dtype: torch.dtype, update: bool) -> torch.Tensor:  # noqa: E501
        recipe = layer.fp8_recipe
        x2d = x  # 2-D: the caller reshapes outside the Function (its output must not be a view)
        with torch.autocast(x.device.type, enabled=False):
            if recipe.nvfp4 is not None:
                nv = recipe.nvfp4
                xq = nvfp4_quantize(x2d, nv.options("activation"))
                wq = nvfp4_quantize(weight, nv.options("weight"))
                sx, sw = xq.decode_scales, wq.decode_scales
                out = (xq.dequantized @ wq.dequantized.t()).to(out_dtype)
                ctx.save_for_backward(x2d, weight)
            elif recipe.scaling in BLOCK_SCALINGS:
                fmt = recipe.formats.forward
                xd, sx = block_fake_quantize(x2d, block_layout(recipe.scaling, "activation"), fmt)
                wd, sw = block_fake_quantize(weight, block_layout(recipe.scaling, "weight"), fmt)
                out = bf16_mm(xd, wd, out_dtype)
                ctx.save_for_backward(x2d, weight)
            else:
                rec = layer._quantizers.begin_forward(update)
                update = update and not rec[1]  # a recompute replays the scales and updates nothing
                qx, sx = layer._quantizers.quantize("activation", x2d, update, rec)
                qw, sw = layer._quantizers.quantize("weight", weight, update, rec)
                ctx.record = rec[0] if not rec[1] else None
                if recipe.gemm_mode == "fp8":
                    out = fp8_mm(qx, sx, qw, sw, out_dtype)
                else:
                    out = bf16_mm(dequantize(qx, sx), dequantize(qw, sw), out_dtype)
                ctx.save_for_backward(qx, qw, sx, sw)
            if bias is not None:
                out = out + bias.to(out_dtype)
        layer._last_scales["activation"] = sx
        layer._last_scales["weight"] = sw
        ctx.layer, ctx.update, ctx.has_bias = layer, update, bias is not None
        ctx.x_dtype, ctx.w_dtype, ctx.out_dtype = x.dtype, weight.dtype, out_dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        layer: EmulatedFP8Layer = ctx.layer
        recipe = layer.fp8_recipe
        g = grad_out
        with torch.autocast(g.device.type, enabled=False):
            if recipe.nvfp4 is not None:
                grad_x, grad_w, sg = _nvfp4_backward(layer, recipe.nvfp4, g, *ctx.saved_tensors, ctx.x_dtype)
            elif recipe.scaling in BLOCK_SCALINGS:
                x2d, weight = ctx.saved_tensors
                fwd, bwd = recipe.formats.forward, recipe.formats.backward
                layout = {k: block_layout(recipe.scaling, k) for k in ("activation", "weight", "gradient")}
                # dgrad reduces over N: dY row-wise, W column-wise (tiles are orientation-free).
                g_row, sg = block_fake_quantize(g, layout["gradient"], bwd)
                w_col = block_fake_quantize(weight.t(), layout["weight"], fwd)[0]
                grad_x = bf16_mm(g_row, w_col, ctx.x_dtype)
                # wgrad reduces over M (tokens): dY and x column-wise.
                g_col = block_fake_quantize(g.t(), layout["gradient"], bwd)[0]
                x_col = block_fake_quantize(x2d.t(), layout["activation"], fwd)[0]
                grad_w = bf16_mm(g_col, x_col, torch.float32)
            else:
                qx, qw, sx, sw = ctx.saved_tensors
                qg, sg = layer._quantizers.quantize("gradient", g, ctx.update)
                layer._quantizers.end_backward(ctx.record)
                if recipe.gemm_mode == "fp8":
                    grad_x = fp8_mm(qg, sg, qw.t(), sw, ctx.x_dtype)
                    grad_w = fp8_mm(qg.t(), sg, qx.t(), sx, torch.float32)
                else:
                    gd = dequantize(qg, sg)
                    grad_x = bf16_mm(gd, dequantize(qw, sw).t(), ctx.x_dtype)
                    grad_w = bf16_mm(gd.t(), dequantize(qx, sx).t(), torch.float32)
            grad_b = g.to(torch.float32).sum(0) if ctx.has_bias else None
        layer._last_scales["gradient"] = sg
        return (
            grad_x,
            grad_w.to(ctx.w_dtype),
            grad_b.to(ctx.w_dtype) if grad_b is not None else None,
            None,
            None,
            None,
        )


def _nvfp4_backward(
    layer: EmulatedFP8Layer, nv: NVFP4Recipe, g: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor,
    x_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dgrad and wgrad of TE's NVFP4 recipe: dY row-wise (stochastic rounding) times the weight's
    column-wise copy (16x16 tiles are the same in both orientations); for wgrad, dY and x
    column-wise (blocks along tokens), both Hadamard-transformed along the tokens, whose product
    the orthonormal transform leaves unchanged: ``(dY^T H)(x^T H)^T = dY^T x``."""
    gen = layer._sr_generator(g.device) if nv.stochastic_rounding else None
    gq = nvfp4_quantize(g, nv.options("gradient"), gen)
    w_col = nvfp4_quantize(weight.t(), nv.options("weight", columnwise=True)).dequantized
    grad_x = (gq.dequantized @ w_col.t()).to(x_dtype)
    g_col = nvfp4_quantize(g.t(), nv.options("gradient", columnwise=True), gen).dequantized
    x_col = nvfp4_quantize(x2d.t(), nv.options("activation", columnwise=True)).dequantized
    return grad_x, g_col @ x_col.t(), gq.decode_scales


SR_STATE_KEY = "nvfp4_sr_generators"
"""``_extra_state`` key of the stochastic-rounding generator states (beside the tensor kinds)."""


class EmulatedFP8Layer:
    """What both emulated FP8 GEMM layers share: the recipe, the scale state, the FP8 forward.

    Attributes:
        fp8_recipe: the recipe (the ``bf16`` recipe runs the original high-precision forward).
    """

    fp8_recipe: Recipe
    _quantizers: Quantizers
    _last_scales: dict[str, torch.Tensor]
    training: bool

    def _init_fp8(self, recipe: Recipe | str) -> None:
        self.fp8_recipe = Recipe.parse(recipe)
        self._quantizers = Quantizers(self.fp8_recipe)
        self._last_scales = {}
        self._generators: dict[torch.device, torch.Generator] = {}

    def _sr_generator(self, device: torch.device) -> torch.Generator:
        """This layer's stochastic-rounding generator on ``device`` (private, seeded: see
        :func:`fp8track.numerics.nvfp4.new_generator`)."""
        if device not in self._generators:
            self._generators[device] = new_generator(device)
        return self._generators[device]

    def _fp8_gemm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T + b`` in emulated FP8, ``weight`` given ``[out, in]``."""
        dev = x.device.type
        out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            out_dtype = torch.float32
        update = self.training and torch.is_grad_enabled()
        # The Function sees 2-D operands and returns a fresh tensor; the reshape happens out here,
        # so the output is an ordinary view that in-place ops (``y.add_(...)``) may modify.
        out = _EmulatedFP8LinearFn.apply(x.reshape(-1, x.shape[-1]), weight, bias, self, out_dtype, update)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def fp8_scales(self) -> dict[str, torch.Tensor]:
        """Scale actually used per tensor kind on the most recent forward / backward (on device).

        Per-tensor recipes give 0-d float32 tensors; block recipes the block-scale tensor of the
        forward GEMM's operands (activation, weight) and of ``dY`` for the dgrad GEMM (gradient).
        Kinds not yet seen (no backward so far) are absent; the ``bf16`` recipe gives ``{}``.
        """
        return dict(self._last_scales)

    def get_extra_state(self) -> dict[str, Any]:
        """Delayed-scaling amax histories and scales (per tensor kind), and the NVFP4 stochastic-
        rounding generators' states (``SR_STATE_KEY``: device -> ``ByteTensor``), so a resumed run
        draws the same roundings as an uninterrupted one; empty for other recipes."""
        state: dict[str, Any] = {k: s.state_dict() for k, s in self._quantizers.delayed.items()}
        if self._generators:
            state[SR_STATE_KEY] = {str(d): g.get_state() for d, g in self._generators.items()}
        return state

    def set_extra_state(self, state: dict[str, Any]) -> None:
        for k, s in (state or {}).items():
            if k in self._quantizers.delayed:
                self._quantizers.delayed[k].load_state_dict(s)
            elif k == SR_STATE_KEY:
                for device, g_state in s.items():
                    self._sr_generator(torch.device(device)).set_state(g_state.cpu())

    @property
    def delayed_scalers(self) -> dict[str, DelayedScaler]:
        """The per-tensor :class:`DelayedScaler` objects (empty unless the recipe is ``delayed``)."""
        return dict(self._quantizers.delayed)


class EmulatedFP8Linear(EmulatedFP8Layer, nn.Linear):
    """An ``nn.Linear`` that runs its GEMMs in emulated FP8 under a
    :class:`~fp8track.execution.recipes.Recipe`.

    Example:
        >>> import torch
        >>> from fp8track.execution.recipes import Recipe
        >>> layer = EmulatedFP8Linear.from_linear(torch.nn.Linear(32, 16), Recipe("current"))
        >>> y = layer(torch.randn(4, 32)); sorted(layer.fp8_scales())
        ['activation', 'weight']
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        recipe: Recipe,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._init_fp8(recipe)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Recipe | str) -> EmulatedFP8Linear:
        """Wrap ``linear``'s own ``weight``/``bias`` Parameters (identity kept, no copy)."""
        new = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            recipe=Recipe.parse(recipe),
            device="meta",
        )
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        return new

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (nn.Linear's name: fc(input=x) works)
        if not self.fp8_recipe.quantizes:
            return F.linear(input, self.weight, self.bias)
        return self._fp8_gemm(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.fp8_recipe}"


class EmulatedFP8Conv1D(EmulatedFP8Layer, InOutWeightGemm):
    """Hugging Face's ``transformers.pytorch_utils.Conv1D`` (GPT-2's GEMMs) in emulated FP8.

    ``Conv1D`` computes ``y = x @ W + b`` with ``W`` stored ``[in, out]``; this layer keeps that
    Parameter (identity, shape and state-dict key unchanged) and runs the same FP8 GEMM as
    :class:`EmulatedFP8Linear` on the view ``W^T`` (``[out, in]``). Under the ``bf16`` recipe the
    forward is ``Conv1D``'s own ``addmm``, bit for bit.

    Attributes:
        nf: output features; nx: input features (``Conv1D``'s names).
    """

    def __init__(self, conv: nn.Module, recipe: Recipe | str) -> None:
        super().__init__()
        self.nf = int(conv.nf)
        self.nx = int(conv.weight.shape[0])
        self.weight = conv.weight
        self.bias = conv.bias
        self._init_fp8(recipe)
        self.train(conv.training)

    @classmethod
    def from_conv1d(cls, conv: nn.Module, recipe: Recipe | str) -> EmulatedFP8Conv1D:
        """Wrap ``conv``'s own ``weight``/``bias`` Parameters (identity kept, no copy)."""
        return cls(conv, recipe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fp8_recipe.quantizes:
            # transformers.pytorch_utils.Conv1D.forward
            size_out = x.size()[:-1] + (self.nf,)
            return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)
        return self._fp8_gemm(x, self.weight.t(), self.bias)

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}, recipe={self.fp8_recipe}"
