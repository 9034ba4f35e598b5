"""Stand-ins for Transformer Engine classes, for class-name / structure dispatch tests only.

TE cannot be imported without CUDA. fp8track recognises TE modules and quantizers by class name
along the MRO, so these classes carry TE's module path and names; their arithmetic is plain
PyTorch and no test takes a statistic from them (the numbers come from fp8track's own code).
"""

from __future__ import annotations

import contextlib
import types

import torch
from torch import nn
from torch.nn import functional as F

_MOD = "transformer_engine.pytorch.module"


class Linear(nn.Module):
    """The constructor signature of ``te.Linear`` that fp8track uses (CPU parameters)."""

    def __init__(self, in_features, out_features, bias=True, params_dtype=None, device=None, name=None):
        super().__init__()
        self.in_features, self.out_features, self.name = in_features, out_features, name
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=params_dtype))
        self.weight.te_tag = True  # TE tags its parameters (tensor-parallel attributes)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=params_dtype)) if bias else None
        self.fp8_meta = {}

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class LayerNormMLP(nn.Module):
    """Structure of ``te.LayerNormMLP``: fc1 and fc2 inside one module."""

    def __init__(self, hidden, ffn, name=None):
        super().__init__()
        self.name = name
        self.fc1_weight = nn.Parameter(torch.randn(ffn, hidden) * 0.1)
        self.fc2_weight = nn.Parameter(torch.randn(hidden, ffn) * 0.1)

    def forward(self, x):
        return F.linear(F.gelu(F.linear(F.layer_norm(x, x.shape[-1:]), self.fc1_weight)), self.fc2_weight)


class GroupedLinear(nn.Module):
    def __init__(self, num_gemms, name=None):
        super().__init__()
        self.num_gemms, self.name = num_gemms, name


class Float8Quantizer:
    def __init__(self, scale, dtype="kFloat8E4M3"):
        self.scale, self.dtype = torch.tensor([scale]), types.SimpleNamespace(name=dtype)


class Float8CurrentScalingQuantizer:
    def __init__(self, dtype="kFloat8E4M3", force_pow_2_scales=False, amax_epsilon=0.0):
        self.dtype = types.SimpleNamespace(name=dtype)
        self.force_pow_2_scales, self.amax_epsilon = force_pow_2_scales, amax_epsilon


class Float8BlockQuantizer:
    def __init__(self, block_scaling_dim=1, force_pow_2_scales=True, dtype="kFloat8E4M3"):
        self.dtype = types.SimpleNamespace(name=dtype)
        self.block_scaling_dim, self.force_pow_2_scales = block_scaling_dim, force_pow_2_scales


class MXFP8Quantizer:
    def __init__(self, dtype="kFloat8E4M3"):
        self.dtype = types.SimpleNamespace(name=dtype)


class DelayedScaling:
    def __init__(self, margin=0, fp8_format=None, **kw):
        self.margin, self.fp8_format = margin, fp8_format


class Float8CurrentScaling:
    def __init__(self, fp8_format=None):
        self.fp8_format = fp8_format


for _cls, _where in [
    (Linear, f"{_MOD}.linear"),
    (LayerNormMLP, f"{_MOD}.layernorm_mlp"),
    (GroupedLinear, f"{_MOD}.grouped_linear"),
    (Float8Quantizer, "transformer_engine.pytorch.tensor.float8_tensor"),
    (Float8CurrentScalingQuantizer, "transformer_engine.pytorch.tensor.float8_tensor"),
    (Float8BlockQuantizer, "transformer_engine.pytorch.tensor.float8_blockwise_tensor"),
    (MXFP8Quantizer, "transformer_engine.pytorch.tensor.mxfp8_tensor"),
    (DelayedScaling, "transformer_engine.common.recipe"),
    (Float8CurrentScaling, "transformer_engine.common.recipe"),
]:
    _cls.__module__ = _where


def modules() -> tuple[types.SimpleNamespace, types.SimpleNamespace]:
    """``(te, te_recipe)`` namespaces as :func:`fp8track.execution.backends.te.import_te` returns."""
    calls: list[dict] = []

    @contextlib.contextmanager
    def autocast(enabled=True, recipe=None):
        calls.append({"enabled": enabled, "recipe": recipe})
        yield

    te = types.SimpleNamespace(Linear=Linear, autocast=autocast, autocast_calls=calls)
    fmt = types.SimpleNamespace(
        HYBRID=types.SimpleNamespace(name="HYBRID"), E4M3=types.SimpleNamespace(name="E4M3")
    )
    recipe = types.SimpleNamespace(
        Format=fmt,
        DelayedScaling=DelayedScaling,
        Float8CurrentScaling=Float8CurrentScaling,
        MXFP8BlockScaling=lambda **kw: ("MXFP8BlockScaling", kw),
        Float8BlockScaling=lambda **kw: ("Float8BlockScaling", kw),
    )
    return te, recipe
