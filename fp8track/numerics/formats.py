"""FP8 formats and their limits.

Two FP8 element formats exist (OCP FP8, as in PyTorch ``float8_e4m3fn`` / ``float8_e5m2``), plus
NVFP4's E2M1 (max 6), which only :mod:`fp8track.numerics.nvfp4` quantises:

======  =======  ==============  ==================
name    max      smallest normal smallest subnormal
======  =======  ==============  ==================
e4m3    448      2**-6           2**-9
e5m2    57344    2**-14          2**-16
e2m1    6        1               0.5
======  =======  ==============  ==================

Recipes pick a *format pair*: ``e4m3`` uses E4M3 for every tensor, ``hybrid`` uses E4M3 for the
forward tensors (activation, weight) and E5M2 for gradients (Transformer Engine's
``Format.HYBRID``).

Block-scaled recipes (MXFP8) store one scale per block as an E8M0 byte: a bare biased exponent,
``code = log2(scale) + 127`` for scales 2**-127 .. 2**127; code 255 is NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp8track.errors import invalid_choice

TENSOR_KINDS = ("activation", "weight", "gradient")
"""The three GEMM operands fp8track observes: forward input, weight, and backward dY."""


@dataclass(frozen=True)
class FP8Format:
    """One FP8 element format.

    Attributes:
        name: ``"e4m3"`` or ``"e5m2"``.
        dtype: the matching ``torch`` float8 dtype.
        max: largest finite magnitude.
        smallest_normal: smallest positive normal value (2**(1 - bias)).
        smallest_subnormal: smallest positive value (2**(1 - bias - mantissa_bits)).
        mantissa_bits: explicit mantissa bits.
        emax: exponent of ``max`` (floor(log2(max))), used by MX block scales.
    """

    name: str
    dtype: torch.dtype
    max: float
    smallest_normal: float
    smallest_subnormal: float
    mantissa_bits: int
    emax: int


E4M3 = FP8Format("e4m3", torch.float8_e4m3fn, 448.0, 2.0**-6, 2.0**-9, 3, 8)
E5M2 = FP8Format("e5m2", torch.float8_e5m2, 57344.0, 2.0**-14, 2.0**-16, 2, 15)

# NVFP4's element format (OCP E2M1: 0, 0.5, 1, 1.5, 2, 3, 4, 6), quantised only by
# fp8track.numerics.nvfp4 (two-level scales); here so statistics finalise with its max (6).
E2M1 = FP8Format("e2m1", torch.float4_e2m1fn_x2, 6.0, 1.0, 0.5, 1, 2)

FORMATS: dict[str, FP8Format] = {f.name: f for f in (E4M3, E5M2, E2M1)}


def get_format(fmt: str | FP8Format) -> FP8Format:
    """Return the :class:`FP8Format` named ``fmt`` (``"e4m3"`` or ``"e5m2"``).

    Raises:
        ConfigError: for an unknown name, listing the valid ones.
    """
    if isinstance(fmt, FP8Format):
        return fmt
    try:
        return FORMATS[str(fmt).lower()]
    except KeyError:
        raise invalid_choice("FP8 format", fmt, FORMATS) from None


@dataclass(frozen=True)
class FormatPair:
    """The element format a recipe uses for each tensor kind.

    Attributes:
        name: ``"hybrid"`` or ``"e4m3"`` (Transformer Engine's ``Format`` names, lower case).
        forward: format of activations and weights.
        backward: format of gradients.
    """

    name: str
    forward: FP8Format
    backward: FP8Format

    def for_tensor(self, tensor: str) -> FP8Format:
        """The format used for ``tensor`` (one of :data:`TENSOR_KINDS`)."""
        if tensor not in TENSOR_KINDS:
            raise invalid_choice("tensor kind", tensor, TENSOR_KINDS)
        return self.backward if tensor == "gradient" else self.forward


HYBRID = FormatPair("hybrid", E4M3, E5M2)
E4M3_ONLY = FormatPair("e4m3", E4M3, E4M3)
FORMAT_PAIRS: dict[str, FormatPair] = {p.name: p for p in (HYBRID, E4M3_ONLY)}


def get_format_pair(name: str | FormatPair) -> FormatPair:
    """Return the :class:`FormatPair` named ``name`` (``"hybrid"`` or ``"e4m3"``)."""
    if isinstance(name, FormatPair):
        return name
    try:
        return FORMAT_PAIRS[str(name).lower()]
    except KeyError:
        raise invalid_choice(
            "fp8_format", name, FORMAT_PAIRS, "Pure E5M2 training is not supported"
        ) from None


# --- E8M0 block scales -------------------------------------------------------------------------
E8M0_BIAS = 127
E8M0_NAN = 255


def e8m0_encode(exponent: torch.Tensor) -> torch.Tensor:
    """Encode integer power-of-two exponents as E8M0 bytes (uint8, ``exponent + 127``).

    Exponents outside [-127, 127] saturate to the nearest representable code (0 or 254).
    """
    return (exponent.to(torch.int32) + E8M0_BIAS).clamp(0, 254).to(torch.uint8)


def e8m0_decode(code: torch.Tensor) -> torch.Tensor:
    """Decode E8M0 bytes to float32 scales ``2**(code - 127)``; code 255 decodes to NaN."""
    exponent = code.to(torch.int32) - E8M0_BIAS
    value = torch.exp2(exponent.to(torch.float32))
    return torch.where(code == E8M0_NAN, torch.full_like(value, float("nan")), value)


_E4M3_VALUES: list[torch.Tensor] = []  # the 256 codes' float32 values, built on first use


def fp8_to_float32(q: torch.Tensor) -> torch.Tensor:
    """The exact float32 values of ``q``, as ``q.to(torch.float32)`` returns them.

    On CPU torch 2.13 converts e4m3fn element by element (about 5 ns per element, 4x an e5m2 or
    bfloat16 upcast), which made the emulated GEMMs' operand upcasts a fifth of a CPU training
    step. A one-byte float has 256 codes, so the same values come from a gather out of a
    256-entry table that torch's own cast filled once: identical results, about twice as fast
    (e5m2's own cast is faster than the gather, so other dtypes and devices take the plain cast).
    """
    if q.device.type != "cpu" or q.dtype != torch.float8_e4m3fn:
        return q.to(torch.float32)
    if not _E4M3_VALUES:
        _E4M3_VALUES.append(torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32))
    return torch.take(_E4M3_VALUES[0], q.view(torch.uint8).to(torch.int64))
