"""The resolution of a fallback spec's terms against a model (the grammar and its meaning are in
:mod:`fp8track.execution.fallback`'s docstring): which GEMM layers each term keeps in BF16 and why,
and the notes :meth:`~fp8track.execution.fallback.FallbackSpec.explain` gives.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from fp8track.errors import ConfigError
from fp8track.execution.blocks import block_stacks, execution_order, linear_names, output_head
from fp8track.execution.experts import MOE_KEYWORDS, find_moe, projection_of_row
from fp8track.execution.layers import expert_param_name, match_layers, preview_names

KEYWORDS = (
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
"""Every term form a spec may hold (the spec's checks and the error messages list them)."""

HEAD_REASON = "head (output layer; Megatron-LM never runs its output layer in FP8)"

Ranking = Sequence[str] | Mapping[str, float]
"""Layer names riskiest first, or name -> risk score (higher = riskier), for ``auto:K`` terms."""


class Resolution:
    """One resolution of a spec's terms against ``model``: the layers chosen so far with the reason
    (the first term that chose a layer gives it), the notes, and the model's structure (stacks of
    repeated blocks, single linears in execution or registration order) computed once, when a term
    first needs it.

    Raises:
        ConfigError: the model has no linear layer.
    """

    def __init__(self, model: nn.Module, example_inputs: Any = None) -> None:
        self.model = model
        self.example_inputs = example_inputs
        self.linears = linear_names(model)
        if not self.linears:
            raise ConfigError("the model has no linear layers to run in FP8")
        self.chosen: dict[str, str] = {}
        self.notes: list[str] = []
        self._stacks: list[tuple[str, list[str]]] | None = None
        self._singles: list[str] | None = None

    def stacks(self) -> list[tuple[str, list[str]]]:
        if self._stacks is None:
            self._stacks = block_stacks(self.model)
        return self._stacks

    def order(self) -> list[str]:
        """Single linears in execution order (with ``example_inputs``), else registration order."""
        if self._singles is None:
            self._singles = (
                execution_order(self.model, self.example_inputs)
                if self.example_inputs is not None
                else self.linears
            )
        return self._singles

    def take(self, names: Sequence[str], reason: str) -> None:
        for n in names:
            self.chosen.setdefault(n, reason)

    def add(self, term: str, ranking: Ranking | None = None) -> None:
        """Choose the layers of one (normalised) term.

        Raises:
            ConfigError: a term matching nothing, a missing module, ``auto:K`` without ranking.
        """
        if term.startswith(("first:", "last:")):
            self._blocks(term)
        elif term == "head":
            self._head()
        elif term.startswith("auto:"):
            k = int(term.split(":")[1])
            for n, why in _from_ranking(ranking, k, self.linears, term, self.model).items():
                self.chosen.setdefault(n, why)
        elif term in MOE_KEYWORDS:
            hits = moe_keyword_layers(self.model, term, self.linears)
            self.take(hits, f"{term} (mixture-of-experts keyword)")
            if not hits:  # routers that are no linear layer (Mixtral's gate): high precision anyway
                self.notes.append(
                    f"{term}: {', '.join(find_moe(self.model).keyword_modules(term))} run their "
                    "GEMMs in their own forward (no linear layer), in high precision"
                )
        else:
            self.take(
                _match_term(self.model, term, self.linears),
                term if term.startswith("re:") else f"named {term}",
            )

    def _blocks(self, term: str) -> None:
        """``first:N`` / ``last:N`` (or ``P%``): N blocks at that end of every stack, or N single
        linears when the model has no repeated blocks."""
        side, n_text = term.split(":")
        stacks = self.stacks()
        if not stacks:
            order = self.order()
            n = block_count(n_text, len(order))
            if n > len(order):
                raise ConfigError(
                    f"bf16_layers term {term!r} asks for {n} linears but the model has {len(order)} "
                    f"and no repeated blocks: {preview_names(order)}"
                )
            self.take(order[:n] if side == "first" else order[len(order) - n :], term)
            return
        for stack, blocks in stacks:
            n = block_count(n_text, len(blocks))
            if n > len(blocks):
                raise ConfigError(
                    f"bf16_layers term {term!r} asks for {n} blocks but stack {stack!r} "
                    f"has {len(blocks)}: {preview_names(blocks)}"
                )
            picked = blocks[:n] if side == "first" else blocks[len(blocks) - n :]
            for b in picked:
                self.take(match_layers(self.model, b, self.linears), f"{term} (block {b})")

    def _head(self) -> None:
        head = output_head(self.model, self.order(), [b for _, blocks in self.stacks() for b in blocks])
        self.take(head, HEAD_REASON)
        self.notes.append(
            f"head: {', '.join(head)} (the linears after the last block; "
            "Megatron-LM never runs its output layer in FP8)"
            if head
            else "head: none (no linear comes after the last repeated block; "
            "name the output layer if it has one)"
        )

    def result(self, block_terms: Sequence[str]) -> tuple[dict[str, str], tuple[str, ...]]:
        """``({linear name: reason}, notes)``: the layers in registration order (``<experts>.<param>``
        names after them); the block terms' notes (``block_terms``: the spec's ``first:`` /
        ``last:`` terms) first."""
        notes = list(self.notes)
        if block_terms:
            label = ", ".join(block_terms)
            kept = {why.split("(block ", 1)[1][:-1] for why in self.chosen.values() if "(block " in why}
            if self._stacks:
                notes[:0] = [
                    f"{label}: stack {stack} ({len(blocks)} blocks) keeps "
                    f"{', '.join(b for b in blocks if b in kept)}"
                    for stack, blocks in self._stacks
                ]
            else:
                counted = "execution" if self.example_inputs is not None else "registration"
                notes.insert(0, f"{label}: no repeated blocks, so single linears were counted "
                                f"({counted} order)")
        ordered = {n: self.chosen[n] for n in self.linears if n in self.chosen}
        ordered.update({n: why for n, why in self.chosen.items() if n not in ordered})  # <experts>.<param>
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
        raise ConfigError(f"{err}; or one of the spec keywords: {', '.join(KEYWORDS)}") from None


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
