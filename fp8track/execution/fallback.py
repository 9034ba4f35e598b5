"""Which linear layers stay in BF16: the fallback spec and its resolution against a model.

Grammar (a string of comma-separated terms, or a sequence of terms; a regex containing a comma
must be given in the sequence form):

=================  ==========================================================================
``none``           every linear runs in FP8
``first``          ``first:1``
``last``           ``last:1``
``first_last``     ``first:1``, ``last:1`` and ``head``: Megatron-LM's
                   ``--first-last-layers-bf16`` as Megatron runs it (its output layer is
                   never an FP8 module); ``first_last:N`` keeps N blocks at each end
``first:N``        the first N repeated blocks of every stack (Megatron
                   ``--num-layers-at-start-in-bf16``)
``last:N``         the last N repeated blocks of every stack (``--num-layers-at-end-in-bf16``)
``first:P%``,     a fraction of every stack's blocks, rounded up (torchtitan's NVFP4 recipe:
``last:P%``       ``last:15%,head``, the last ~15 % of blocks and the LM head)
``head``           the output head: the linears after the last repeated block (``lm_head``,
                   a classifier with its pooler, CLIP's projections), plus Hugging Face's
                   ``get_output_embeddings()``; without repeated blocks, the last linear;
                   nothing (said in the notes, not an error) for a bare stack of blocks
``re:PATTERN``     every linear whose qualified name matches ``re.search(PATTERN, name)``
``auto:K``         the K riskiest layers of a ranking the monitor produces (riskiest first)
any other term     a module's qualified name: a linear, or a module whose linears all stay
=================  ==========================================================================

How ``first``/``last`` count. *Repeated blocks* are the children of ``nn.ModuleList`` /
``nn.Sequential`` containers whose children all share one type and hold at least one linear.
Among those child types, the one with the most instances is the block type (ties go to the type
met first in ``named_modules`` order; lists of bare linears count only when nothing else
repeats, so per-head projections inside a block never outnumber the blocks; a type without
normalisation layers inside a type with them, such as the expert MLPs of a mixture-of-experts
layer, yields to the enclosing layer). Other block types
with at least two instances, neither inside nor around those blocks, are further towers (BART's
decoder layers beside its encoder layers).

*Stacks*: the blocks are grouped by their container's name with list indices read as ``*``, so
the two towers of an encoder-decoder or two-tower model (T5's ``encoder.block`` and
``decoder.block``, CLIP's ``text_model.encoder.layers`` and ``vision_model.encoder.layers``) are
two stacks, while nested stages (``stages.0.blocks``, ``stages.1.blocks``) are one stack counted
across stages. ``first:N``/``last:N`` take N blocks at each end of every stack; a stack with
fewer than N blocks is an error naming it. Every linear inside a chosen block stays in BF16. A
model without repeated blocks counts single linear layers instead, in execution order when
``example_inputs`` are given to :func:`resolve_fallback` (one forward under ``no_grad`` records
it) and in registration order otherwise (equal for ``nn.Sequential``).

:meth:`FallbackSpec.explain` says in words what the spec kept and why (the ``ApplyReport``
carries it). A term that matches no layer, or names a missing module, raises
:class:`ConfigError` naming the candidates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from fp8track.errors import ConfigError
from fp8track.execution.fallback_resolve import KEYWORDS, Resolution
from fp8track.execution.layers import compile_selector


@dataclass(frozen=True)
class FallbackSpec:
    """A parsed fallback spec (validated at construction; resolve it with :meth:`resolve`).

    Attributes:
        terms: the normalised terms, e.g. ``("first:1", "re:lm_head")``; empty means ``none``.
    """

    terms: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for term in self.terms:
            _validate_term(term)

    @classmethod
    def parse(cls, spec: FallbackSpec | str | Sequence[str] | None) -> FallbackSpec:
        """Parse a string (comma-separated), a sequence of terms, ``None`` or ``"none"``."""
        if isinstance(spec, FallbackSpec):
            return spec
        if spec is None:
            return cls(())
        if isinstance(spec, str):
            raw = [t for t in (p.strip() for p in spec.split(",")) if t]
        elif isinstance(spec, Sequence):
            raw = [str(t).strip() for t in spec]
        else:
            raise ConfigError(
                f"bf16_layers must be a string or a sequence of strings, got {type(spec).__name__}"
            )
        terms: list[str] = []
        for t in raw:
            if t == "none":
                continue
            if t == "first" or t == "last":
                t = f"{t}:1"
            if t == "first_last" or t.startswith("first_last:"):
                n = t.split(":", 1)[1] if ":" in t else "1"
                terms += [f"first:{n}", f"last:{n}", "head"]
                continue
            terms.append(t)
        if "none" in raw and terms:
            raise ConfigError(f"bf16_layers 'none' cannot be combined with other terms, got {spec!r}")
        return cls(tuple(terms))

    @classmethod
    def from_megatron(
        cls,
        first_last_layers_bf16: bool,
        num_layers_at_start_in_bf16: int = 1,
        num_layers_at_end_in_bf16: int = 1,
    ) -> FallbackSpec:
        """The spec matching Megatron-LM's ``--first-last-layers-bf16`` and its two counts, as
        Megatron runs it: the output layer (``output_layer``, a plain ``ColumnParallelLinear``,
        never a Transformer Engine module) stays out of FP8 in every case, so ``head`` is always there."""
        if not first_last_layers_bf16:
            return cls(("head",))
        terms = []
        if num_layers_at_start_in_bf16:
            terms.append(f"first:{num_layers_at_start_in_bf16}")
        if num_layers_at_end_in_bf16:
            terms.append(f"last:{num_layers_at_end_in_bf16}")
        return cls((*terms, "head"))

    @property
    def needs_ranking(self) -> bool:
        """True when the spec holds an ``auto:K`` term."""
        return any(t.startswith("auto:") for t in self.terms)

    def __str__(self) -> str:
        return ",".join(self.terms) if self.terms else "none"

    def resolve(
        self,
        model: nn.Module,
        ranking: Sequence[str] | Mapping[str, float] | None = None,
        example_inputs: Any = None,
    ) -> dict[str, str]:
        """Map each linear that stays in BF16 to the reason (the term that chose it).

        Args:
            model: the model, before any FP8 conversion.
            ranking: for ``auto:K``: layer names riskiest first, or a mapping name -> risk score
                (higher = riskier).
            example_inputs: optional inputs for one forward pass, to count single linears in
                execution order when the model has no repeated blocks.

        Returns:
            ``{linear name: reason}`` in registration order.

        Raises:
            ConfigError: a term matching nothing, a missing module, ``auto:K`` without ranking.
        """
        return self.resolve_with_notes(model, ranking, example_inputs)[0]

    def explain(
        self,
        model: nn.Module,
        ranking: Sequence[str] | Mapping[str, float] | None = None,
        example_inputs: Any = None,
    ) -> tuple[str, ...]:
        """What the block and head terms kept and why, one sentence each (empty for other specs),
        e.g. ``"first:1, last:1: stack model.encoder.layers (3 blocks) keeps model.encoder.layers.0,
        model.encoder.layers.2"``. Same arguments as :meth:`resolve`."""
        return self.resolve_with_notes(model, ranking, example_inputs)[1]

    def resolve_with_notes(
        self,
        model: nn.Module,
        ranking: Sequence[str] | Mapping[str, float] | None = None,
        example_inputs: Any = None,
    ) -> tuple[dict[str, str], tuple[str, ...]]:
        """:meth:`resolve` and :meth:`explain` from one resolution."""
        resolution = Resolution(model, example_inputs)
        for term in self.terms:
            resolution.add(term, ranking)
        return resolution.result([t for t in self.terms if t.startswith(("first:", "last:"))])


def _is_percentage(count: str) -> bool:
    try:
        return count.endswith("%") and 0.0 < float(count[:-1]) <= 100.0
    except ValueError:
        return False


def _validate_term(term: str) -> None:
    if not term:
        raise ConfigError("empty bf16_layers term")
    if term.startswith(("first:", "last:")) and _is_percentage(term.split(":", 1)[1]):
        return
    if term.startswith(("first:", "last:", "auto:")):
        count = term.split(":", 1)[1]
        if not count.isdigit() or int(count) < 1:
            raise ConfigError(
                f"bf16_layers term {term!r} needs a positive integer count "
                "(or, for first:/last:, a percentage in (0, 100]); "
                f"valid forms: {', '.join(KEYWORDS)}"
            )
    elif term.startswith("re:"):
        compile_selector(term, "bf16_layers")
    elif term == "head":
        return
    elif term in ("none", "first", "last", "first_last"):
        raise ConfigError(f"bf16_layers term {term!r} must go through FallbackSpec.parse")
    elif ":" in term:
        # KEYWORD:ARG with an unknown keyword ("lst:1"): a module's qualified name holds no colon,
        # so this is a misspelt keyword, refused here rather than when the model is resolved
        # (after a sweep's trials have already started and failed on it).
        raise ConfigError(
            f"bf16_layers term {term!r}: unknown keyword {term.split(':', 1)[0]!r}; "
            f"valid forms: {', '.join(KEYWORDS)}"
        )


def resolve_fallback(
    model: nn.Module,
    spec: FallbackSpec | str | Sequence[str] | None,
    ranking: Sequence[str] | Mapping[str, float] | None = None,
    example_inputs: Any = None,
) -> dict[str, str]:
    """Shortcut for ``FallbackSpec.parse(spec).resolve(model, ranking, example_inputs)``."""
    return FallbackSpec.parse(spec).resolve(model, ranking, example_inputs)
