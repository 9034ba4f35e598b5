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

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fp8track.errors import ConfigError
from fp8track.execution.experts import MOE_KEYWORDS, find_moe, projection_of_row
from fp8track.execution.layers import (
    compile_selector,
    expert_param_name,
    gemm_layers,
    is_gemm_layer,
    match_layers,
    preview_names,
)

_KEYWORDS = (
    "none",
    "first",
    "last",
    "first_last",
    "first:N",
    "last:N",
    "first:P%",
    "last:P%",
    "first_last:N",
    "head",
    "re:PATTERN",
    "auto:K",
    *MOE_KEYWORDS,
)

HEAD_REASON = "head (output layer; Megatron-LM never runs its output layer in FP8)"


def linear_names(model: nn.Module) -> list[str]:
    """Qualified names of every GEMM layer (:func:`~fp8track.execution.layers.is_gemm_layer`) in
    registration order, the root excluded (it cannot be swapped in place)."""
    return [name for name, _ in gemm_layers(model) if name]


def block_stacks(model: nn.Module) -> list[tuple[str, list[str]]]:
    """``(stack, blocks)`` of the model's repeated blocks grouped by stack (see the module
    docstring), stacks in order of their first block, blocks in ``named_modules`` order.

    ``stack`` is the container's qualified name with list indices as ``*`` (``stages.*.blocks``).
    """
    by_type: dict[type, list[str]] = {}
    first: dict[type, nn.Module] = {}  # one instance per type, for the GEMM-layer predicate
    container_of: dict[str, str] = {}
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
        container_of.update({prefix + n: cname for n, _ in children})
        first.setdefault(ctype, children[0][1])
    # Lists of bare linears (e.g. per-head projections inside a block) only count as blocks when
    # nothing else repeats, so they cannot outnumber the transformer blocks that hold them.
    composite = {t: names for t, names in by_type.items() if not is_gemm_layer(first[t])}
    pool = composite or by_type
    if not pool:
        return []
    best_type = max(pool, key=lambda t: len(pool[t]))  # max() keeps the first of equal lengths
    # Mixture-of-experts: lists of expert MLPs inside every layer outnumber the layers. A block type
    # holding normalisation layers that encloses the chosen type, which holds none, is the layer.
    if not _has_norm(first[best_type]):
        for t, names in pool.items():
            if t is not best_type and len(names) >= 2 and _has_norm(first[t]):
                if any(_nested(b, n) for b in pool[best_type] for n in names):
                    best_type = t
                    break
    best = pool[best_type]
    if len(best) < 2:
        return []
    blocks = list(best)
    for names in pool.values():  # further towers: other block types beside (not around) these
        if names is best or len(names) < 2:
            continue
        if not any(_nested(a, b) or _nested(b, a) for a in names for b in blocks):
            blocks += names
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    stacks: dict[str, list[str]] = {}
    for b in sorted(blocks, key=order.__getitem__):
        stacks.setdefault(re.sub(r"(?<![^.])\d+(?![^.])", "*", container_of[b]), []).append(b)
    return list(stacks.items())


def _has_norm(module: nn.Module) -> bool:
    return any("norm" in type(m).__name__.lower() for m in module.modules())


def _nested(inner: str, outer: str) -> bool:
    return outer == "" or inner == outer or inner.startswith(outer + ".")


def repeated_blocks(model: nn.Module) -> list[str]:
    """Qualified names of the model's repeated blocks, every stack's, in ``named_modules`` order."""
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return sorted((b for _, blocks in block_stacks(model) for b in blocks), key=order.__getitem__)


def output_head(model: nn.Module, order: Sequence[str], blocks: Sequence[str]) -> list[str]:
    """The output head: linears of ``order`` (every linear, in execution or registration order)
    that come after the last linear inside ``blocks``, plus Hugging Face's
    ``get_output_embeddings()`` when it is a linear; without blocks, the last linear."""
    inside = [i for i, n in enumerate(order) if any(_nested(n, b) for b in blocks)]
    start = inside[-1] + 1 if inside else len(order) - 1
    head = [n for n in order[start:] if not any(_nested(n, b) for b in blocks)]
    try:
        out = (
            model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
        )
    except (NotImplementedError, AttributeError):
        out = None
    if isinstance(out, nn.Module):
        head += [n for n in order if model.get_submodule(n) is out and n not in head]
    return head


def execution_order(model: nn.Module, example_inputs: Any) -> list[str]:
    """Linear names in the order one forward pass calls them (each name once, first call wins)."""
    order: list[str] = []
    handles = []
    for name, m in gemm_layers(model):
        if name:
            handles.append(
                m.register_forward_pre_hook(
                    lambda _m, _a, n=name: order.append(n) if n not in order else None
                )
            )
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
        linears = linear_names(model)
        if not linears:
            raise ConfigError("the model has no linear layers to run in FP8")
        chosen: dict[str, str] = {}
        notes: list[str] = []
        stacks: list[tuple[str, list[str]]] | None = None
        singles: list[str] | None = None
        block_terms = [t for t in self.terms if t.startswith(("first:", "last:"))]

        def take(names: Sequence[str], reason: str) -> None:
            for n in names:
                chosen.setdefault(n, reason)

        def order() -> list[str]:
            nonlocal singles
            if singles is None:
                singles = execution_order(model, example_inputs) if example_inputs is not None else linears
            return singles

        for term in self.terms:
            if term.startswith(("first:", "last:")):
                side, n_text = term.split(":")
                if stacks is None:
                    stacks = block_stacks(model)
                if stacks:
                    for stack, blocks in stacks:
                        n = block_count(n_text, len(blocks))
                        if n > len(blocks):
                            raise ConfigError(
                                f"bf16_layers term {term!r} asks for {n} blocks but stack {stack!r} "
                                f"has {len(blocks)}: "
                                f"{preview_names(blocks)}"
                            )
                        picked = blocks[:n] if side == "first" else blocks[len(blocks) - n :]
                        for b in picked:
                            take(match_layers(model, b, linears), f"{term} (block {b})")
                else:
                    n = block_count(n_text, len(order()))
                    if n > len(order()):
                        raise ConfigError(
                            f"bf16_layers term {term!r} asks for {n} linears but the model has "
                            f"{len(order())} "
                            f"and no repeated blocks: {preview_names(order())}"
                        )
                    take(order()[:n] if side == "first" else order()[len(order()) - n :], term)
            elif term == "head":
                if stacks is None:
                    stacks = block_stacks(model)
                head = output_head(model, order(), [b for _, blocks in stacks for b in blocks])
                take(head, HEAD_REASON)
                notes.append(
                    f"head: {', '.join(head)} (the linears after the last block; "
                    "Megatron-LM never runs its output layer in FP8)"
                    if head
                    else "head: none (no linear comes after the last repeated block; "
                    "name the output layer if it has one)"
                )
            elif term.startswith("auto:"):
                k = int(term.split(":")[1])
                for n, why in _from_ranking(ranking, k, linears, term, model).items():
                    chosen.setdefault(n, why)
            elif term in MOE_KEYWORDS:
                hits = moe_keyword_layers(model, term, linears)
                take(hits, f"{term} (mixture-of-experts keyword)")
                if not hits:  # routers that are no linear layer (Mixtral's gate): high precision anyway
                    notes.append(f"{term}: {', '.join(find_moe(model).keyword_modules(term))} run their "
                                 "GEMMs in their own forward (no linear layer), in high precision")
            else:
                take(_match_term(model, term, linears), term if term.startswith("re:") else f"named {term}")
        if block_terms:
            label = ", ".join(block_terms)
            kept = {
                b for n, why in chosen.items() if "(block " in why for b in [why.split("(block ", 1)[1][:-1]]
            }
            if stacks:
                notes[:0] = [
                    f"{label}: stack {stack} ({len(blocks)} blocks) keeps "
                    f"{', '.join(b for b in blocks if b in kept)}"
                    for stack, blocks in stacks
                ]
            else:
                notes.insert(0, f"{label}: no repeated blocks, so single linears were counted "
                                f"({'execution' if example_inputs is not None else 'registration'} order)")
        ordered = {n: chosen[n] for n in linears if n in chosen}
        ordered.update({n: why for n, why in chosen.items() if n not in ordered})  # <experts>.<param>
        return ordered, tuple(notes)


def moe_keyword_layers(model: nn.Module, keyword: str, names: Sequence[str]) -> list[str]:
    """The GEMM layers among ``names`` that a mixture-of-experts keyword (``experts``, ``router``,
    ``shared_experts``) picks: fused expert modules and module-list experts' linears, router
    linears and shared-expert gates, or the shared experts' linears.

    Returns:
        the picked names, in the order of ``names``; empty when the parts exist but hold no GEMM
        layer (routers computing their logits in their own forward, as Mixtral's ``gate``).

    Raises:
        ConfigError: the model has no such part (the message says what it has).
    """
    modules = find_moe(model).keyword_modules(keyword)
    hits = [n for n in names if any(n == m or n.startswith(m + ".") for m in modules)]
    if not modules:
        raise ConfigError(
            f"keyword {keyword!r} names no layer: the model has no mixture-of-experts "
            f"{keyword.replace('_', ' ')} (linear layers: {preview_names(list(names))})"
        )
    return hits


def _match_term(model: nn.Module, term: str, linears: Sequence[str]) -> list[str]:
    try:
        return match_layers(model, term, linears, "bf16_layers term")
    except ConfigError as err:
        raise ConfigError(f"{err}; or one of the spec keywords: {', '.join(_KEYWORDS)}") from None


def _from_ranking(
    ranking: Sequence[str] | Mapping[str, float] | None, k: int, linears: Sequence[str], term: str,
    model: nn.Module | None = None,
) -> dict[str, str]:
    if ranking is None:
        raise ConfigError(
            f"bf16_layers term {term!r} needs a layer ranking (from the monitor's diagnosis); none given"
        )
    if isinstance(ranking, Mapping):
        ordered = sorted(ranking, key=lambda n: -float(ranking[n]))
    else:
        ordered = list(ranking)
    # One expert's row designates its projection (<experts>.<param>); experts of one projection
    # ranked apart count once, at the best rank.
    ordered = list(dict.fromkeys(_linear_named(projection_of_row(n), linears) for n in ordered))
    unknown = [
        n for n in ordered
        if n not in linears and not (model is not None and expert_param_name(model, n, linears))
    ]
    if unknown:
        raise ConfigError(
            f"ranking names layers the model lacks: {preview_names(unknown)}; "
            f"linear layers: {preview_names(linears)}"
        )
    if k > len(ordered):
        raise ConfigError(f"bf16_layers term {term!r} asks for {k} layers but the ranking has {len(ordered)}")
    return {n: f"{term} (rank {i + 1})" for i, n in enumerate(ordered[:k])}


def _linear_named(name: str, linears: Sequence[str]) -> str:
    """The linear layer a ranking's ``name`` designates: itself, or the one linear whose name ends
    with ``"." + name``. The monitor records canonical names (``fp8track.monitoring.naming``), without
    a LightningModule's ``model.`` holder or a wrapper prefix that this model's names may carry.
    A fused experts projection ``<experts>.<param>`` keeps its ``.<param>`` on its experts' name."""
    if name in linears:
        return name
    hits = [n for n in linears if n.endswith("." + name)]
    if len(hits) == 1:
        return hits[0]
    owner, _, param = name.rpartition(".")
    hits = [n for n in linears if owner and (n == owner or n.endswith("." + owner))]
    return f"{hits[0]}.{param}" if len(hits) == 1 else name


def block_count(count: str, total: int) -> int:
    """Blocks a ``first:``/``last:`` count asks for out of ``total``: ``N``, or ``P%`` of ``total``
    rounded up (torchtitan's NVFP4 recipe keeps the last ~15 % of blocks in BF16: ``last:15%`` of
    32 blocks keeps 5; any positive percentage keeps at least one)."""
    if count.endswith("%"):
        return math.ceil(float(count[:-1]) / 100.0 * total - 1e-9)
    return int(count)


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
                f"valid forms: {', '.join(_KEYWORDS)}"
            )
    elif term.startswith("re:"):
        compile_selector(term, "bf16_layers")
    elif term == "head":
        return
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
