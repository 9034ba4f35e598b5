"""Which linear layers stay in BF16: the fallback spec and its resolution against a model.

Grammar (a string of comma-separated terms, or a sequence of terms; a regex containing a comma
must be given in the sequence form):

=================  ==========================================================================
``none``           every linear runs in FP8
``first``          ``first:1``
``last``           ``last:1``
``first_last``     ``first:1`` and ``last:1`` (Megatron-LM ``--first-last-layers-bf16``);
                   ``first_last:N`` keeps N at each end
``first:N``        the first N repeated blocks (Megatron ``--num-layers-at-start-in-bf16``)
``last:N``         the last N repeated blocks (``--num-layers-at-end-in-bf16``)
``re:PATTERN``     every linear whose qualified name matches ``re.search(PATTERN, name)``
``auto:K``         the K riskiest layers of a ranking the monitor produces (riskiest first)
any other term     a module's qualified name: a linear, or a module whose linears all stay
=================  ==========================================================================

How ``first``/``last`` count. *Repeated blocks* are the children of ``nn.ModuleList`` /
``nn.Sequential`` containers whose children all share one type and hold at least one linear.
Among those child types, the one with the most instances is the block type (ties go to the type
met first in ``named_modules`` order; lists of bare linears count only when nothing else
repeats, so per-head projections inside a block never outnumber the blocks); the blocks are all children of such containers with that
type, in ``named_modules`` order. For nested stages (a ModuleList of stages, each holding a
ModuleList of blocks) this counts the inner blocks across stages. Every linear inside a chosen
block stays in BF16. A model without repeated blocks counts single linear layers instead, in
execution order when ``example_inputs`` are given to :func:`resolve_fallback` (one forward
under ``no_grad`` records it) and in registration order otherwise (equal for ``nn.Sequential``).

Layers outside the blocks (embeddings' neighbours, ``lm_head``) are never counted by
``first``/``last``: name them, or use ``re:``, as Megatron-LM also leaves them to the user.

A term that matches no layer, or names a missing module, raises :class:`ConfigError` naming the
candidates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fp8track.errors import ConfigError
from fp8track.execution.layers import (
    compile_selector,
    gemm_layers,
    is_gemm_layer,
    match_layers,
    preview_names,
)

_KEYWORDS = ("none", "first", "last", "first_last", "first:N", "last:N", "first_last:N", "re:PATTERN", "auto:K")


def linear_names(model: nn.Module) -> list[str]:
    """Qualified names of every GEMM layer (:func:`~fp8track.execution.layers.is_gemm_layer`) in
    registration order, the root excluded (it cannot be swapped in place)."""
    return [name for name, _ in gemm_layers(model) if name]


def repeated_blocks(model: nn.Module) -> list[str]:
    """Qualified names of the model's repeated blocks (see the module docstring), in order."""
    by_type: dict[type, list[str]] = {}
    first: dict[type, nn.Module] = {}  # one instance per type, for the GEMM-layer predicate
    for cname, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(container.named_children())
        if len(children) < 1:
            continue
        types = {type(c) for _, c in children}
        if len(types) != 1:
            continue
        (ctype,) = types
        if not any(is_gemm_layer(m) for _, c in children for m in c.modules()):
            continue
        prefix = f"{cname}." if cname else ""
        by_type.setdefault(ctype, []).extend(prefix + n for n, _ in children)
        first.setdefault(ctype, children[0][1])
    # Lists of bare linears (e.g. per-head projections inside a block) only count as blocks when
    # nothing else repeats, so they cannot outnumber the transformer blocks that hold them.
    composite = {t: names for t, names in by_type.items() if not is_gemm_layer(first[t])}
    pool = composite or by_type
    if not pool:
        return []
    best = max(pool.values(), key=len)  # max() keeps the first of equal lengths
    return best if len(best) >= 2 else []


def execution_order(model: nn.Module, example_inputs: Any) -> list[str]:
    """Linear names in the order one forward pass calls them (each name once, first call wins)."""
    order: list[str] = []
    handles = []
    for name, m in gemm_layers(model):
        if name:
            handles.append(m.register_forward_pre_hook(lambda _m, _a, n=name: order.append(n) if n not in order else None))
    try:
        with torch.no_grad():
            if isinstance(example_inputs, Mapping):
                model(**example_inputs)
            elif isinstance(example_inputs, tuple):
                model(*example_inputs)
            else:
                model(example_inputs)
    finally:
        for h in handles:
            h.remove()
    never_called = [n for n in linear_names(model) if n not in order]
    return order + never_called


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
            raise ConfigError(f"bf16_layers must be a string or a sequence of strings, got {type(spec).__name__}")
        terms: list[str] = []
        for t in raw:
            if t == "none":
                continue
            if t == "first" or t == "last":
                t = f"{t}:1"
            if t == "first_last" or t.startswith("first_last:"):
                n = t.split(":", 1)[1] if ":" in t else "1"
                terms += [f"first:{n}", f"last:{n}"]
                continue
            terms.append(t)
        if "none" in raw and terms:
            raise ConfigError(f"bf16_layers 'none' cannot be combined with other terms, got {spec!r}")
        return cls(tuple(terms))

    @classmethod
    def from_megatron(
        cls, first_last_layers_bf16: bool, num_layers_at_start_in_bf16: int = 1, num_layers_at_end_in_bf16: int = 1
    ) -> FallbackSpec:
        """The spec matching Megatron-LM's ``--first-last-layers-bf16`` and its two counts."""
        if not first_last_layers_bf16:
            return cls(())
        terms = []
        if num_layers_at_start_in_bf16:
            terms.append(f"first:{num_layers_at_start_in_bf16}")
        if num_layers_at_end_in_bf16:
            terms.append(f"last:{num_layers_at_end_in_bf16}")
        return cls(tuple(terms))

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
        linears = linear_names(model)
        if not linears:
            raise ConfigError("the model has no linear layers to run in FP8")
        chosen: dict[str, str] = {}
        blocks: list[str] | None = None
        singles: list[str] | None = None

        def take(names: Sequence[str], reason: str) -> None:
            for n in names:
                chosen.setdefault(n, reason)

        for term in self.terms:
            if term.startswith(("first:", "last:")):
                side, n_text = term.split(":")
                n = int(n_text)
                if blocks is None:
                    blocks = repeated_blocks(model)
                if blocks:
                    if n > len(blocks):
                        raise ConfigError(
                            f"bf16_layers term {term!r} asks for {n} blocks but the model has {len(blocks)}: "
                            f"{preview_names(blocks)}"
                        )
                    picked = blocks[:n] if side == "first" else blocks[len(blocks) - n :]
                    for b in picked:
                        take(match_layers(model, b, linears), f"{term} (block {b})")
                else:
                    if singles is None:
                        singles = execution_order(model, example_inputs) if example_inputs is not None else linears
                    if n > len(singles):
                        raise ConfigError(
                            f"bf16_layers term {term!r} asks for {n} linears but the model has {len(singles)} "
                            f"and no repeated blocks: {preview_names(singles)}"
                        )
                    take(singles[:n] if side == "first" else singles[len(singles) - n :], term)
            elif term.startswith("auto:"):
                k = int(term.split(":")[1])
                for n, why in _from_ranking(ranking, k, linears, term).items():
                    chosen.setdefault(n, why)
            else:
                hits = match_layers(model, term, linears, "bf16_layers term")
                take(hits, term if term.startswith("re:") else f"named {term}")
        return {n: chosen[n] for n in linears if n in chosen}


def _from_ranking(
    ranking: Sequence[str] | Mapping[str, float] | None, k: int, linears: Sequence[str], term: str
) -> dict[str, str]:
    if ranking is None:
        raise ConfigError(f"bf16_layers term {term!r} needs a layer ranking (from the monitor's diagnosis); none given")
    if isinstance(ranking, Mapping):
        ordered = sorted(ranking, key=lambda n: -float(ranking[n]))
    else:
        ordered = list(ranking)
    ordered = [_linear_named(n, linears) for n in ordered]
    unknown = [n for n in ordered if n not in linears]
    if unknown:
        raise ConfigError(
            f"ranking names layers the model lacks: {preview_names(unknown)}; linear layers: {preview_names(linears)}"
        )
    if k > len(ordered):
        raise ConfigError(f"bf16_layers term {term!r} asks for {k} layers but the ranking has {len(ordered)}")
    return {n: f"{term} (rank {i + 1})" for i, n in enumerate(ordered[:k])}


def _linear_named(name: str, linears: Sequence[str]) -> str:
    """The linear layer a ranking's ``name`` designates: itself, or the one linear whose name ends
    with ``"." + name``. The monitor records canonical names (``fp8track.monitoring.naming``), without
    a LightningModule's ``model.`` holder or a wrapper prefix that this model's names may carry."""
    if name in linears:
        return name
    hits = [n for n in linears if n.endswith("." + name)]
    return hits[0] if len(hits) == 1 else name


def _validate_term(term: str) -> None:
    if not term:
        raise ConfigError("empty bf16_layers term")
    if term.startswith(("first:", "last:", "auto:")):
        count = term.split(":", 1)[1]
        if not count.isdigit() or int(count) < 1:
            raise ConfigError(f"bf16_layers term {term!r} needs a positive integer count; valid forms: {', '.join(_KEYWORDS)}")
    elif term.startswith("re:"):
        compile_selector(term, "bf16_layers")
    elif term in ("none", "first", "last", "first_last"):
        raise ConfigError(f"bf16_layers term {term!r} must go through FallbackSpec.parse")


def resolve_fallback(
    model: nn.Module,
    spec: FallbackSpec | str | Sequence[str] | None,
    ranking: Sequence[str] | Mapping[str, float] | None = None,
    example_inputs: Any = None,
) -> dict[str, str]:
    """Shortcut for ``FallbackSpec.parse(spec).resolve(model, ranking, example_inputs)``."""
    return FallbackSpec.parse(spec).resolve(model, ranking, example_inputs)
