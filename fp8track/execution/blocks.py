"""How a model is built, as the fallback spec counts it: its GEMM layers, its repeated blocks
grouped into stacks (encoder / decoder, towers), its output head, and the order one forward pass
calls its linears. The rules (which containers count as blocks, how stacks are named) are in
:mod:`fp8track.execution.fallback`'s docstring.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fp8track.execution.layers import gemm_layers, is_gemm_layer


def linear_names(model: nn.Module) -> list[str]:
    """Qualified names of every GEMM layer (:func:`~fp8track.execution.layers.is_gemm_layer`) in
    registration order, the root excluded (it cannot be swapped in place)."""
    return [name for name, _ in gemm_layers(model) if name]


def block_stacks(model: nn.Module) -> list[tuple[str, list[str]]]:
    """``(stack, blocks)`` of the model's repeated blocks grouped by stack (see
    :mod:`fp8track.execution.fallback`), stacks in order of their first block, blocks in
    ``named_modules`` order.

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
