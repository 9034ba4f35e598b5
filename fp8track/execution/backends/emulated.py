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

The ``bf16`` recipe runs ``F.linear`` unchanged, so the control goes through the same module.
:class:`EmulatedFP8Conv1D` does the same for Hugging Face's ``Conv1D`` (GPT-2), whose weight is
stored ``[in, out]``: the same GEMMs on ``W^T``.
The output dtype is the autocast dtype when autocast is on, else the input's dtype.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fp8track.execution.backends.base import Backend, Converted, ScaleFn, ScaleRule, register
from fp8track.execution.checkpointing import ForwardScales, RecomputeQueue
from fp8track.execution.experts import expert_group
from fp8track.execution.fp8_experts import EmulatedFP8Experts, convert_experts, unconverted_reason
from fp8track.execution.layers import InOutWeightGemm, is_hf_conv1d
from fp8track.execution.recipes import Recipe
from fp8track.numerics.nvfp4 import NVFP4Recipe, new_generator, nvfp4_quantize
from fp8track.numerics.scaling import (
    BLOCK_SCALINGS,
    DelayedScaler,
    amax,
    block_fake_quantize,
    block_layout,
    current_scale,
    dequantize,
    quantize,
)

__all__ = [
    "EmulatedBackend",
    "EmulatedFP8Conv1D",
    "EmulatedFP8Layer",
    "EmulatedFP8Linear",
    "block_fake_quantize",
]


def _fits_scaled_mm(a: torch.Tensor, b: torch.Tensor) -> bool:
    # cuBLASLt FP8 GEMMs need both inner and outer dims in multiples of 16.
    return a.shape[1] % 16 == 0 and b.shape[1] % 16 == 0 and a.shape[0] % 16 == 0


def _fp8_values_mm(a: torch.Tensor, sa: torch.Tensor, b_t: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    """What ``_scaled_mm`` computes, in float32: exact FP8 x FP8 products, float32 accumulation,
    ``scale_inv`` of both operands applied to the accumulator."""
    return (a.to(torch.float32) @ b_t.to(torch.float32).t()) * (sa * sb).reciprocal()


def _fp8_mm(
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


def _bf16_mm(a_deq: torch.Tensor, b_t_deq: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return (a_deq.to(torch.bfloat16) @ b_t_deq.to(torch.bfloat16).t()).to(out_dtype)


class _Quantizers:
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
                out = _bf16_mm(xd, wd, out_dtype)
                ctx.save_for_backward(x2d, weight)
            else:
                rec = layer._quantizers.begin_forward(update)
                update = update and not rec[1]  # a recompute replays the scales and updates nothing
                qx, sx = layer._quantizers.quantize("activation", x2d, update, rec)
                qw, sw = layer._quantizers.quantize("weight", weight, update, rec)
                ctx.record = rec[0] if not rec[1] else None
                if recipe.gemm_mode == "fp8":
                    out = _fp8_mm(qx, sx, qw, sw, out_dtype)
                else:
                    out = _bf16_mm(dequantize(qx, sx), dequantize(qw, sw), out_dtype)
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
                grad_x = _bf16_mm(g_row, w_col, ctx.x_dtype)
                # wgrad reduces over M (tokens): dY and x column-wise.
                g_col = block_fake_quantize(g.t(), layout["gradient"], bwd)[0]
                x_col = block_fake_quantize(x2d.t(), layout["activation"], fwd)[0]
                grad_w = _bf16_mm(g_col, x_col, torch.float32)
            else:
                qx, qw, sx, sw = ctx.saved_tensors
                qg, sg = layer._quantizers.quantize("gradient", g, ctx.update)
                layer._quantizers.end_backward(ctx.record)
                if recipe.gemm_mode == "fp8":
                    grad_x = _fp8_mm(qg, sg, qw.t(), sw, ctx.x_dtype)
                    grad_w = _fp8_mm(qg.t(), sg, qx.t(), sx, torch.float32)
                else:
                    gd = dequantize(qg, sg)
                    grad_x = _bf16_mm(gd, dequantize(qw, sw).t(), ctx.x_dtype)
                    grad_w = _bf16_mm(gd.t(), dequantize(qx, sx).t(), torch.float32)
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
    _quantizers: _Quantizers
    _last_scales: dict[str, torch.Tensor]
    training: bool

    def _init_fp8(self, recipe: Recipe | str) -> None:
        self.fp8_recipe = Recipe.parse(recipe)
        self._quantizers = _Quantizers(self.fp8_recipe)
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


class EmulatedBackend(Backend):
    """``backend="emulated"``: :class:`EmulatedFP8Linear` / :class:`EmulatedFP8Conv1D` on any device.

    Layers of ``names`` outside ``keep_bf16`` are swapped; under the ``bf16`` recipe they run the
    plain forward, so the control goes through the same module code. Fallback layers stay as they are.
    """

    name = "emulated"
    auto_priority = 0
    converts_experts = True

    def owns(self, module: nn.Module) -> bool:
        return isinstance(module, (EmulatedFP8Layer, EmulatedFP8Experts))

    def is_fp8(self, module: nn.Module) -> bool:
        if isinstance(module, EmulatedFP8Experts):
            return bool(module.fp8_params)
        return isinstance(module, EmulatedFP8Layer) and module.fp8_recipe.quantizes

    def recipe_of(self, module: nn.Module) -> Recipe | None:
        return module.fp8_recipe if isinstance(module, (EmulatedFP8Layer, EmulatedFP8Experts)) else None

    def used_scales(self, module: nn.Module) -> dict[str, torch.Tensor] | None:
        if isinstance(module, EmulatedFP8Experts):
            return None  # per expert and projection: fp8_scales() / fp8_quantizers(param)
        return module.fp8_scales() if self.is_fp8(module) else None  # type: ignore[union-attr]

    def scale_fns(self, module: nn.Module) -> dict[str, ScaleFn]:
        fns = super().scale_fns(module)
        scaler = module.delayed_scalers.get("gradient") if isinstance(module, EmulatedFP8Layer) else None
        if scaler is not None:
            # dY is observed before the layer's backward: the scale that backward is about to use.
            fns["gradient"] = lambda: scaler.scale.clone()
        return fns

    def scale_rule(self, module: nn.Module) -> ScaleRule:
        recipe = self.recipe_of(module)
        assert recipe is not None
        return ScaleRule(recipe.scaling, recipe.margin, nvfp4=recipe.nvfp4)

    def convert(
        self, model: nn.Module, recipe: Recipe, names: Sequence[str], keep_bf16: Collection[str]
    ) -> Converted:
        fp8, unconverted = [], {}
        for n in names:
            if n in keep_bf16:
                continue
            layer = model.get_submodule(n)
            group = expert_group(n, layer)
            if group is not None:
                params = [p.name for p in group.params if f"{n}.{p.name}" not in keep_bf16]
                why = unconverted_reason(group, layer, recipe) if recipe.quantizes else None
                if why is not None:
                    unconverted[n] = why
                elif recipe.quantizes and params:
                    convert_experts(layer, recipe, group, params)
                    whole = len(params) == len(group.params)
                    fp8.extend([n] if whole else [f"{n}.{p}" for p in params])
                continue
            wrap = EmulatedFP8Conv1D.from_conv1d if is_hf_conv1d(layer) else EmulatedFP8Linear.from_linear
            model.set_submodule(n, wrap(layer, recipe))
            if recipe.quantizes:
                fp8.append(n)
        return Converted(tuple(fp8), unconverted=unconverted)


register(EmulatedBackend())
