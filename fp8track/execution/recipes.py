"""FP8 recipes: what is quantised, in which format, with which scales, and how the GEMM runs.

A :class:`Recipe` is a frozen, validated description that every backend reads. Names follow
Transformer Engine and Megatron-LM where they exist (``--fp8-recipe``, ``--fp8-format``,
``--fp8-amax-history-len``, ``--fp8-amax-compute-algo``, ``--fp8-margin``):

======================  ====================================================================
name                    meaning (TE class)
======================  ====================================================================
``bf16``                no quantisation: the control run, through the same code path
``delayed``             per-tensor delayed scaling from an amax history (``DelayedScaling``)
``current``             per-tensor current scaling (``Float8CurrentScaling``; Megatron's
                        ``tensorwise``; torchao's ``tensorwise``/``rowwise`` variants)
``mxfp8``               1x32 blocks, E8M0 power-of-two scales (``MXFP8BlockScaling``)
``block``               1x128 blocks for activation and gradient, 128x128 tiles for the weight,
                        power-of-two scales (``Float8BlockScaling``; Megatron's ``blockwise``)
``fp8_input_bf16_gemm`` current scaling, operands quantised then dequantised, BF16 GEMM
``nvfp4``               E2M1 values, 1x16 blocks with E4M3 scales and an FP32 global scale,
                        16x16 weight tiles, stochastic rounding of gradients, 16x16 random
                        Hadamard transform on the wgrad operands (``NVFP4BlockScaling``)
======================  ====================================================================

String grammar (:meth:`Recipe.from_string`): ``NAME[:TOKEN]...`` where each token is one of
``hybrid`` | ``e4m3`` (format), ``h<N>`` (amax history length), ``max`` | ``most_recent``
(amax compute algorithm), ``m<N>`` (margin), ``gemm=fp8`` | ``gemm=bf16`` (GEMM mode),
``variant=<torchao variant>``, and for ``nvfp4`` TE's switches ``no_rht``, ``no_sr``, ``no_2d``
(``NVTE_NVFP4_DISABLE_RHT``, ``..._STOCHASTIC_ROUNDING``, ``..._2D_QUANTIZATION``).
Example: ``"delayed:hybrid:h16:max"``. Each option is given at
most once and only to a recipe it applies to (:data:`RECIPE_OPTIONS`: ``h<N>`` and
``max|most_recent`` to ``delayed``, ``m<N>`` to ``delayed``/``current``/``fp8_input_bf16_gemm``, ...);
an inapplicable option at its default value is accepted, so the canonical strings of
:meth:`Recipe.to_string` parse. Without a format token a
recipe takes Transformer Engine's default for its class (:data:`TE_DEFAULT_FORMATS`): ``hybrid``
for ``delayed`` and ``current``, ``e4m3`` for ``mxfp8`` and ``block``. Aliases:
``tensorwise`` = ``current``, ``blockwise`` = ``block``, ``rowwise`` and ``rowwise_with_gw_hp``
= ``current`` with that torchao variant and ``e4m3`` (torchao uses e4m3 for every operand there).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fp8track.errors import ConfigError, check_int, invalid_choice
from fp8track.numerics.formats import E2M1, FORMAT_PAIRS, FormatPair, get_format_pair
from fp8track.numerics.nvfp4 import NVFP4Recipe
from fp8track.numerics.scaling import AMAX_COMPUTE_ALGOS

RECIPE_NAMES = ("bf16", "delayed", "current", "mxfp8", "block", "fp8_input_bf16_gemm", "nvfp4")
GEMM_MODES = ("auto", "fp8", "bf16")
"""``fp8``: FP8 x FP8 GEMM with scales applied to the float32 accumulator (``torch._scaled_mm``);
``bf16``: operands quantised, dequantised to BF16, BF16 GEMM; ``auto``: the recipe's own choice
(``bf16`` for ``fp8_input_bf16_gemm``, ``fp8`` otherwise)."""
TORCHAO_VARIANTS = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
ALIASES: dict[str, dict[str, Any]] = {
    "tensorwise": {"name": "current"},
    "blockwise": {"name": "block"},
    "rowwise": {"name": "current", "variant": "rowwise", "fp8_format": "e4m3"},
    "rowwise_with_gw_hp": {"name": "current", "variant": "rowwise_with_gw_hp", "fp8_format": "e4m3"},
}
# Transformer Engine's default ``fp8_format`` of each recipe class, as declared in
# transformer_engine/common/recipe/__init__.py: DelayedScaling.fp8_format = Format.HYBRID,
# Float8CurrentScaling.fp8_format = Format.HYBRID, MXFP8BlockScaling.fp8_format = Format.E4M3,
# Float8BlockScaling.fp8_format = Format.E4M3. fp8_input_bf16_gemm is current scaling; bf16 quantises
# nothing (its format only judges shadow statistics, as the delayed default does).
TE_DEFAULT_FORMATS: dict[str, str] = {
    "bf16": "hybrid",
    "delayed": "hybrid",
    "current": "hybrid",
    "mxfp8": "e4m3",
    "block": "e4m3",
    "fp8_input_bf16_gemm": "hybrid",
    # NVFP4BlockScaling.fp8_format = Format.E4M3 (its block scales; the values are E2M1).
    "nvfp4": "e4m3",
}
# The options that mean something for each recipe (besides ``name``), as in Transformer Engine's recipe
# classes (transformer_engine/common/recipe/__init__.py): only DelayedScaling has amax_history_len and
# amax_compute_algo; margin is DelayedScaling's (fp8track also applies it to current scaling, as
# Megatron's --fp8-margin does; MXFP8BlockScaling and Float8BlockScaling have none: their scales are
# powers of two from each block's amax); the torchao variant belongs to current scaling; bf16 quantises
# nothing, its format only judges the shadow statistics. A field outside its recipe's set must keep its
# default: Recipe("mxfp8", margin=2) or "current:h16" would otherwise be accepted and silently ignored.
RECIPE_OPTIONS: dict[str, tuple[str, ...]] = {
    "bf16": ("fp8_format",),
    "delayed": ("fp8_format", "amax_history_len", "amax_compute_algo", "margin", "gemm"),
    "current": ("fp8_format", "margin", "gemm", "variant"),
    "mxfp8": ("fp8_format", "gemm"),
    "block": ("fp8_format", "gemm"),
    "fp8_input_bf16_gemm": ("fp8_format", "margin", "gemm"),
    # NVFP4BlockScaling: disable_rht, disable_stochastic_rounding, disable_2d_quantization.
    "nvfp4": ("fp8_format", "disable_rht", "disable_stochastic_rounding", "disable_2d_quantization"),
}
NVFP4_SWITCHES = {
    "no_rht": "disable_rht",
    "no_sr": "disable_stochastic_rounding",
    "no_2d": "disable_2d_quantization",
}
"""Recipe-string tokens of TE's ``NVFP4BlockScaling`` switches -> field names."""
# How each field is written in the string grammar (for messages).
_TOKEN_FORMS = {
    "fp8_format": "hybrid|e4m3",
    "amax_history_len": "h<N>",
    "amax_compute_algo": "max|most_recent",
    "margin": "m<N>",
    "gemm": "gemm=fp8|bf16",
    "variant": "variant=<torchao variant>",
    "disable_rht": "no_rht",
    "disable_stochastic_rounding": "no_sr",
    "disable_2d_quantization": "no_2d",
}
# Megatron-LM / NeMo key spellings accepted by from_dict, mapped to field names.
_KEY_ALIASES = {
    "fp8_recipe": "name",
    "recipe": "name",
    "fp8_margin": "margin",
    "fp8_amax_history_len": "amax_history_len",
    "fp8_amax_compute_algo": "amax_compute_algo",
    "format": "fp8_format",
    "gemm_mode": "gemm",
}


@dataclass(frozen=True)
class Recipe:
    """One FP8 training recipe (validated at construction; raises :class:`ConfigError`).

    Attributes:
        name: one of :data:`RECIPE_NAMES`.
        fp8_format: ``"hybrid"`` (E4M3 forward, E5M2 gradients) or ``"e4m3"`` (E4M3 everywhere);
            ``None`` (the default) takes TE's default of the recipe class (:data:`TE_DEFAULT_FORMATS`)
            and is stored resolved, so ``Recipe("mxfp8") == Recipe("mxfp8", "e4m3")``.
        amax_history_len: delayed scaling's amax history length (TE default 1024,
            ``DelayedScaling.amax_history_len``; Megatron 1).
        amax_compute_algo: ``"max"`` over the history or ``"most_recent"`` entry.
        margin: scale = FP8_MAX / amax / 2**margin (delayed and current scaling).
        gemm: one of :data:`GEMM_MODES` (emulated backend).
        variant: torchao variant of ``current`` (:data:`TORCHAO_VARIANTS`); only ``tensorwise``
            is emulated and run by TE, the row-wise ones run on the torchao backend only.
        disable_rht, disable_stochastic_rounding, disable_2d_quantization: ``nvfp4`` only, TE's
            ``NVFP4BlockScaling`` switches (default False: RHT on the wgrad operands, stochastic
            rounding of gradients, 16x16 weight tiles).
    """

    name: str = "delayed"
    fp8_format: str | None = None
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    margin: int = 0
    gemm: str = "auto"
    variant: str = "tensorwise"
    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False

    def __post_init__(self) -> None:
        if self.name not in RECIPE_NAMES:
            raise invalid_choice("recipe name", self.name, RECIPE_NAMES + tuple(ALIASES))
        if self.fp8_format is None:  # resolved once, so equality, to_dict and to_string are canonical
            object.__setattr__(self, "fp8_format", TE_DEFAULT_FORMATS[self.name])
        if str(self.fp8_format) not in FORMAT_PAIRS:
            raise invalid_choice(
                "fp8_format", self.fp8_format, FORMAT_PAIRS, "Pure E5M2 training is not supported"
            )
        check_int("amax_history_len", self.amax_history_len, 1)
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise invalid_choice("amax_compute_algo", self.amax_compute_algo, AMAX_COMPUTE_ALGOS)
        check_int("margin", self.margin, 0)
        if self.gemm not in GEMM_MODES:
            raise invalid_choice("gemm mode", self.gemm, GEMM_MODES)
        if self.name == "fp8_input_bf16_gemm" and self.gemm == "fp8":
            raise ConfigError(
                "recipe 'fp8_input_bf16_gemm' runs a BF16 GEMM by definition; gemm='fp8' contradicts it"
            )
        if self.name == "nvfp4" and self.fp8_format != "e4m3":
            raise ConfigError(
                f"recipe 'nvfp4' has E4M3 block scales only (TE's NVFP4BlockScaling asserts it); "
                f"got fp8_format={self.fp8_format!r}"
            )
        for switch in NVFP4_SWITCHES.values():
            if not isinstance(getattr(self, switch), bool):
                raise ConfigError(f"{switch} must be True or False, got {getattr(self, switch)!r}")
        if self.variant not in TORCHAO_VARIANTS:
            raise invalid_choice("variant", self.variant, TORCHAO_VARIANTS)
        if self.variant != "tensorwise":
            if self.name != "current":
                raise ConfigError(
                    f"variant {self.variant!r} only exists for recipe 'current', got {self.name!r}"
                )
            if self.fp8_format != "e4m3":
                raise ConfigError(
                    f"torchao's {self.variant!r} uses e4m3 for every operand; set fp8_format='e4m3' "
                    f"(got {self.fp8_format!r})"
                )
        self._check_options_apply()

    def _check_options_apply(self) -> None:
        allowed = RECIPE_OPTIONS[self.name]
        for f in dataclasses.fields(self):
            if f.name == "name" or f.name in allowed or getattr(self, f.name) == f.default:
                continue
            forms = ", ".join(_TOKEN_FORMS[o] for o in allowed)
            raise ConfigError(
                f"{f.name}={getattr(self, f.name)!r} ({_TOKEN_FORMS[f.name]}) "
                f"does not apply to recipe {self.name!r}; "
                f"its options are: {forms}"
            )

    # --- derived properties -------------------------------------------------------------------
    @property
    def quantizes(self) -> bool:
        """False only for the ``bf16`` control."""
        return self.name != "bf16"

    @property
    def scaling(self) -> str:
        """How scales are chosen: ``none``, ``delayed``, ``current``, ``mxfp8``, ``block`` or ``nvfp4``."""
        if self.name == "bf16":
            return "none"
        return "current" if self.name == "fp8_input_bf16_gemm" else self.name

    @property
    def gemm_mode(self) -> str:
        """The resolved GEMM mode, ``"fp8"`` or ``"bf16"`` (``"none"`` for the bf16 control)."""
        if self.name == "bf16":
            return "none"
        if self.gemm != "auto":
            return self.gemm
        return "bf16" if self.name == "fp8_input_bf16_gemm" else "fp8"

    @property
    def formats(self) -> FormatPair:
        """The :class:`~fp8track.numerics.formats.FormatPair` (forward / backward element formats;
        E2M1 for every operand of ``nvfp4``, whose ``fp8_format`` is its block scales')."""
        if self.name == "nvfp4":
            return FormatPair("e2m1", E2M1, E2M1)
        return get_format_pair(self.fp8_format)

    @property
    def nvfp4(self) -> NVFP4Recipe | None:
        """The NVFP4 parts this recipe turns on (``None`` unless ``name == "nvfp4"``)."""
        if self.name != "nvfp4":
            return None
        return NVFP4Recipe(
            rht=not self.disable_rht,
            stochastic_rounding=not self.disable_stochastic_rounding,
            tile_2d=not self.disable_2d_quantization,
        )

    # --- (de)serialisation --------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain data; ``Recipe.from_dict(r.to_dict()) == r``."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Recipe:
        """Build from a mapping; accepts field names and Megatron spellings (``fp8_recipe``,
        ``fp8_margin``, ``fp8_amax_history_len``, ``fp8_amax_compute_algo``; ``-`` or ``_``).

        Raises:
            ConfigError: for unknown keys (listing the valid ones) or invalid values.
        """
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            k = str(key).lstrip("-").replace("-", "_")
            k = _KEY_ALIASES.get(k, k)
            if k not in fields:
                raise invalid_choice("recipe key", key, sorted(fields | set(_KEY_ALIASES)))
            kwargs[k] = value
        name = kwargs.get("name", "delayed")
        if name in ALIASES:
            kwargs = {**ALIASES[name], **{k: v for k, v in kwargs.items() if k != "name"}}
        return cls(**kwargs)

    @classmethod
    def from_string(cls, text: str) -> Recipe:
        """Parse the grammar in the module docstring, e.g. ``"delayed:hybrid:h16:max"``."""
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(f"recipe string must be non-empty, got {text!r}")
        head, *tokens = text.strip().split(":")
        data: dict[str, Any] = {"name": head}
        given: dict[str, str] = {}  # field -> the token that set it
        for tok in tokens:
            for key, value in _parse_token(tok, text).items():
                if key in given:
                    raise ConfigError(
                        f"recipe string {text!r} gives {key} twice ({given[key]!r} and {tok!r}); "
                        f"give one {_TOKEN_FORMS[key]} token"
                    )
                given[key] = tok
                data[key] = value
        return cls.from_dict(data)

    @classmethod
    def parse(cls, spec: Recipe | str | Mapping[str, Any]) -> Recipe:
        """Accept a :class:`Recipe`, a recipe string or a mapping."""
        if isinstance(spec, Recipe):
            return spec
        if isinstance(spec, str):
            return cls.from_string(spec)
        if isinstance(spec, Mapping):
            return cls.from_dict(spec)
        raise ConfigError(f"recipe must be a Recipe, a string or a mapping, got {type(spec).__name__}")

    def to_string(self) -> str:
        """Canonical string form; ``Recipe.from_string(r.to_string()) == r``."""
        parts = [
            self.name,
            self.fp8_format,
            f"h{self.amax_history_len}",
            self.amax_compute_algo,
            f"m{self.margin}",
        ]
        if self.gemm != "auto":
            parts.append(f"gemm={self.gemm}")
        if self.variant != "tensorwise":
            parts.append(f"variant={self.variant}")
        parts.extend(tok for tok, field in NVFP4_SWITCHES.items() if getattr(self, field))
        return ":".join(parts)

    def __str__(self) -> str:
        return self.to_string()


def _parse_token(tok: str, text: str) -> dict[str, Any]:
    grammar = (
        "tokens are hybrid|e4m3, h<N>, max|most_recent, m<N>, gemm=fp8|bf16, variant=<name>, "
        "no_rht|no_sr|no_2d (nvfp4)"
    )
    t = tok.strip()
    if t in NVFP4_SWITCHES:
        return {NVFP4_SWITCHES[t]: True}
    if t in FORMAT_PAIRS:
        return {"fp8_format": t}
    if t in AMAX_COMPUTE_ALGOS:
        return {"amax_compute_algo": t}
    if t[:1] in ("h", "m") and t[1:].isdigit():
        return {"amax_history_len" if t[0] == "h" else "margin": int(t[1:])}
    if "=" in t:
        key, value = t.split("=", 1)
        if key in ("gemm", "variant"):
            return {key: value}
    raise ConfigError(f"cannot parse token {tok!r} in recipe string {text!r}; {grammar}")


def scale_warmup_steps(recipe: Mapping[str, Any] | None) -> int:
    """Steps the recipe's scales need before they follow the tensors (a recipe as
    :meth:`Recipe.to_dict` writes it, or None): delayed scaling fills its amax history first, its
    ``amax_history_len`` steps (TE's ``DelayedScaling`` default 1024); current and block scaling
    compute each scale from the tensor itself and need none. Scale drift inside this window is
    the warm-up, not a problem of the run."""
    if not recipe or recipe.get("name") != "delayed":
        return 0
    n = recipe.get("amax_history_len", Recipe.amax_history_len)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else Recipe.amax_history_len


def recipe_choices() -> tuple[str, ...]:
    """Every name :meth:`Recipe.from_string` accepts as the first token."""
    return RECIPE_NAMES + tuple(ALIASES)
