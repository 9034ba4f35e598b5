"""The one builder of tracker metric names (docs/trackers.md).

Names look like ``fp8/<layer fqn>/<tensor>/<stat>`` (per layer) or ``fp8/<group>/<name>``
(run level). They use only characters MLflow accepts (letters, digits, ``_ - . / space``), never
``%`` (it becomes ``_pct``), have no empty (or dots-only) segment, and are at most 250 characters:
a longer name keeps its tail and gains a short hash of the full name so distinct names stay
distinct. :func:`sanitize_key` applies the same rules to any other name (trackers use it for the
user's params and tags).
"""

from __future__ import annotations

import functools
import hashlib
import re

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


def run_metric(*parts: str) -> str:
    """A run-level name, e.g. ``run_metric("spikes", "count") == "fp8/spikes/count"``."""
    if not parts:
        raise ValueError("run_metric needs at least one name segment")
    return _join(list(parts))


def worst_metric(stat: str) -> str:
    """``fp8/worst/<stat>``: the worst value of ``stat`` over all layers and tensors."""
    return run_metric("worst", stat)
