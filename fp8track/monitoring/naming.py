"""The one builder of tracker metric names (docs/trackers.md).

Names look like ``fp8/<layer fqn>/<tensor>/<stat>`` (per layer) or ``fp8/<group>/<name>``
(run level). They use only characters MLflow accepts (letters, digits, ``_ - . / space``), never
``%`` (it becomes ``_pct``), have no empty (or dots-only) segment, and are at most 250 characters:
a longer name keeps its tail and gains a short hash of the full name so distinct names stay
distinct. :func:`sanitize_key` applies the same rules to any other name (trackers use it for the
user's params and tags).

Layer names are canonical (:func:`canonical_layer_name`): the wrappers that frameworks put around a
user's model (``torch.compile``, DDP, FSDP, Fabric, activation checkpointing, peft) and the
attribute of a LightningModule that holds the model are not part of a layer's name, so the same
model gives the same names from every frontend and its runs can be compared.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Sequence
from typing import Any

from torch import nn

from fp8track.errors import invalid_choice
from fp8track.numerics.formats import TENSOR_KINDS

PREFIX = "fp8"
MAX_NAME_LEN = 250
_BAD_CHARS = re.compile(r"[^A-Za-z0-9_\-. ]")

TABLE_TENSOR_STATS = "fp8_tensor_stats"
TABLE_SPIKE_EVENTS = "fp8_spike_events"
TABLE_DRIFT_EVENTS = "fp8_drift_events"
TABLE_FINDINGS = "fp8_findings"


def sanitize_segment(segment: str) -> str:
    """Make one path segment tracker-safe: ``%`` -> ``_pct``, other bad characters -> ``_``; a
    segment left empty or made only of dots (MLflow rejects ``.`` and ``..``) becomes ``_``."""
    s = _BAD_CHARS.sub("_", str(segment).replace("%", "_pct")).strip()
    return s if s.strip(".") else "_"


def _bound(name: str) -> str:
    """``name`` if it fits :data:`MAX_NAME_LEN`, else its tail after a hash of the whole (and the
    ``fp8/`` prefix when it had one), exactly :data:`MAX_NAME_LEN` long, so distinct names stay distinct."""
    if len(name) <= MAX_NAME_LEN:
        return name
    head = f"{PREFIX}/" if name.startswith(f"{PREFIX}/") else ""
    digest = hashlib.sha1(name.encode()).hexdigest()[:8]
    keep = MAX_NAME_LEN - len(head) - len(digest) - 1
    return f"{head}{digest}-{name[-keep:]}"


def sanitize_key(name: str) -> str:
    """Any name (a user's param, tag or metric key) made tracker-safe: every ``/`` segment through
    :func:`sanitize_segment`, then bounded in length.

    Example:
        >>> sanitize_key("model.fc1/activation/underflows%")
        'model.fc1/activation/underflows_pct'
        >>> sanitize_key("/a//b/./c:d")
        '_/a/_/b/_/c_d'
    """
    return _bound("/".join(sanitize_segment(p) for p in str(name).split("/")))


def _join(segments: list[str]) -> str:
    return _bound("/".join([PREFIX, *(sanitize_segment(s) for s in segments)]))


@functools.lru_cache(maxsize=65536)
def metric_name(layer: str, tensor: str, stat: str) -> str:
    """``fp8/<layer>/<tensor>/<stat>`` for one layer's tensor statistic.

    Example:
        >>> metric_name("blocks.0.attn.qkv", "activation", "underflow%")
        'fp8/blocks.0.attn.qkv/activation/underflow_pct'
    """
    if tensor not in TENSOR_KINDS:
        raise invalid_choice("tensor kind", tensor, TENSOR_KINDS)
    return _join([layer or "model", tensor, stat])


@functools.lru_cache(maxsize=4096)  # every flush names the same run-level metrics again
def run_metric(*parts: str) -> str:
    """A run-level name, e.g. ``run_metric("spikes", "count") == "fp8/spikes/count"``."""
    if not parts:
        raise ValueError("run_metric needs at least one name segment")
    return _join(list(parts))


LOSS_METRIC = run_metric("loss")
"""``fp8/loss``: the training loss as fp8track records it (under ``fp8/`` so it never collides with
the user's own ``loss``)."""


def worst_metric(stat: str) -> str:
    """``fp8/worst/<stat>``: the worst value of ``stat`` over all layers and tensors."""
    return run_metric("worst", stat)


# --- layer names ---------------------------------------------------------------------------------

WRAPPER_SEGMENTS = (
    "_orig_mod",  # torch.compile's OptimizedModule (around the model or any submodule)
    "_fsdp_wrapped_module",  # FSDP1's FlatParameter wrapper
    "_checkpoint_wrapped_module",  # torch.distributed's checkpoint_wrapper
    "_forward_module",  # Lightning Fabric's _FabricModule
    "_original_module",  # ditto, when it differs from the forward module
    "base_layer",  # peft's LoRA layer around the original linear layer
)
"""Name segments of wrapper modules, dropped wherever they occur: nobody names their own layer so."""

LEADING_WRAPPERS = (("module",), ("base_model", "model"))
"""Segment runs dropped only at the start of a name (after other wrappers): DDP / DataParallel's
``module.`` and peft's ``PeftModel`` -> ``LoraModel`` (``base_model.model.``). Inside a model they
could be a user's own attribute names."""


def canonical_layer_name(name: str, holder: str = "") -> str:
    """A layer's name without the wrappers around it: the name the same layer has in the bare model.

    Drops every :data:`WRAPPER_SEGMENTS` segment, the :data:`LEADING_WRAPPERS` at the start, then
    ``holder`` (the attribute of a LightningModule holding the model, :func:`holder_prefix`) when the
    name starts with it. Idempotent for names without a segment equal to ``holder``'s.

    Example:
        >>> canonical_layer_name("_orig_mod.module.blocks.0._checkpoint_wrapped_module.attn.qkv")
        'blocks.0.attn.qkv'
        >>> canonical_layer_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer")
        'model.layers.0.self_attn.q_proj'
        >>> canonical_layer_name("model.blocks.1.mlp.fc", holder="model")
        'blocks.1.mlp.fc'
    """
    parts = [p for p in str(name).split(".") if p not in WRAPPER_SEGMENTS]
    changed = True
    while changed:
        changed = False
        for lead in LEADING_WRAPPERS:
            if len(parts) > len(lead) and tuple(parts[: len(lead)]) == lead:
                parts, changed = parts[len(lead) :], True
    if holder and len(parts) > 1 and parts[0] == holder:
        parts = parts[1:]
    return ".".join(parts)


_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)

_ROOT_WRAPPERS = ("_orig_mod", "_forward_module", "module")
"""Attributes through which a wrapper (compile, Fabric, DDP) holds the module it wraps."""


def _is_lightning_module(obj: Any) -> bool:
    # By class name, not isinstance: monitoring never imports Lightning (pytorch_lightning too).
    return any(
        c.__name__ == "LightningModule" and c.__module__.split(".")[0] in ("lightning", "pytorch_lightning")
        for c in type(obj).__mro__
    )


def holder_prefix(model: Any, names: Sequence[str]) -> str:
    """The attribute of a LightningModule that holds the user's model (``"model"`` for
    ``self.model = GPT(...)``), or ``""``.

    It is that attribute when ``model`` (or the module a wrapper of :data:`WRAPPER_SEGMENTS` holds)
    is a LightningModule and every name of ``names`` (its GEMM layers' names, wrappers dropped) lies
    under that one child, a model class: then a plain loop over the child gives the same names
    without it. A LightningModule with layers of its own (a layer outside the child, or the child a
    ``Sequential``/``ModuleList``/``ModuleDict``) or models in two attributes keeps its names whole;
    the pairing of two runs still aligns such a prefix (:mod:`fp8track.analysis.pairing`).
    """
    root, seen = model, set()
    while not _is_lightning_module(root) and id(root) not in seen:
        seen.add(id(root))
        inner = next(
            (getattr(root, a) for a in _ROOT_WRAPPERS if hasattr(getattr(root, a, None), "named_modules")),
            None,
        )
        if inner is None:
            break
        root = inner
    if not _is_lightning_module(root) or not names:
        return ""
    canon = [canonical_layer_name(n) for n in names]
    heads = {n.split(".", 1)[0] for n in canon}
    if len(heads) != 1 or any("." not in n for n in canon):
        return ""
    head = heads.pop()
    # self.body = nn.Sequential(...) is the module's own layers, not a model it holds ("0", "2"
    # would be no names): only a model class is a holder. A compiled child (torch.compile's
    # OptimizedModule keeps the module as `_orig_mod`) is judged by what it compiled, so a model
    # names its layers the same compiled or not.
    child = getattr(root, head, None)
    child = getattr(child, "_orig_mod", child)
    return "" if isinstance(child, _CONTAINERS) else head


def canonical_layer_names(model: Any, names: Sequence[str]) -> list[str]:
    """:func:`canonical_layer_name` of each of ``model``'s layer ``names`` (its holder dropped,
    :func:`holder_prefix`); the names unchanged when canonical names would collide."""
    holder = holder_prefix(model, names)
    out = [canonical_layer_name(n, holder) for n in names]
    return out if len(set(out)) == len(set(names)) else list(names)
