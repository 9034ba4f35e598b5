"""The one builder of tracker metric names (docs/trackers.md).

Names look like ``fp8/<layer fqn>/<tensor>/<stat>`` (per layer) or ``fp8/<group>/<name>``
(run level). They use only characters MLflow accepts (letters, digits, ``_ - . / space``), never
``%`` (it becomes ``_pct``), have no empty segment, and are at most 250 characters: a longer
name keeps its tail and gains a short hash of the full name so distinct names stay distinct.
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
    """Make one path segment tracker-safe: ``%`` -> ``_pct``, other bad characters -> ``_``."""
    s = str(segment).replace("%", "_pct")
    s = _BAD_CHARS.sub("_", s).strip()
    return s or "_"


def _join(segments: list[str]) -> str:
    name = "/".join([PREFIX, *(sanitize_segment(s) for s in segments)])
    if len(name) <= MAX_NAME_LEN:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:8]
    keep = MAX_NAME_LEN - len(PREFIX) - len(digest) - 3
    return f"{PREFIX}/{digest}-{name[-keep:]}"


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


LOSS_METRIC = run_metric("loss")
"""``fp8/loss``: the training loss as fp8track records it (under ``fp8/`` so it never collides with
the user's own ``loss``)."""


def worst_metric(stat: str) -> str:
    """``fp8/worst/<stat>``: the worst value of ``stat`` over all layers and tensors."""
    return run_metric("worst", stat)
