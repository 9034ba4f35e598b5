"""Bridge from Transformer Engine's debug API (``nvdlfw_inspect``) into fp8track records.

TE's stat features emit scalars named ``{layer}_{tensor}_{stat}`` through
``nvdlfw_inspect.logging.MetricLogger.log_scalar(name, value, iteration)``, for example
``model.layers.3.mlp.fc1_gradient_underflows%`` or
``blocks.0.proj_activation_mxfp8_scale_inv_min_columnwise``. :class:`TEStatsBridge` is a
``statistics_logger`` for ``debug_api.initialize``: it parses each name into layer, tensor,
fp8track statistic and recipe variant, collects one step's values, and hands a
:class:`~fp8track.trackers.base.StepBatch` (scalars named by :mod:`fp8track.monitoring.naming` plus
long-format :class:`~fp8track.monitoring.records.TensorStatsRow` s) to a sink, typically
:func:`record_and_log` (write the run directory, then fan out to the trackers).

Statistic names (TE -> fp8track): ``underflows%`` -> ``underflow_pct``, ``overflows%`` ->
``overflow_pct``, ``cur_amax`` -> ``amax``, ``dynamic_range`` -> ``dynamic_range_log2``;
``mse``, ``scale_inv_min``, ``scale_inv_max``, ``min``, ``max``, ``mean``, ``std``, ``l1_norm``,
``l2_norm`` keep their names; anything else is kept, made tracker-safe.
Recipe prefixes (TE's what-if stats) become the row's ``variant``: ``fp8_delayed_scaling`` ->
``delayed``, ``fp8_current_scaling`` -> ``current``, ``mxfp8`` -> ``mxfp8``,
``fp8_block_scaling`` -> ``block``, ``nvfp4`` -> ``nvfp4``; a ``_columnwise`` suffix appends
``_columnwise`` to the variant. No prefix means the recipe used for training (``actual``).

Layer names join the monitor's rows: TE's ``infer_and_assign_layer_names`` names modules
``model.<path>`` (and a ModuleList child by its ``layer_number`` when it has one), so the bridge
maps a debug name back to the qualified name through the model's modules (:func:`te_layer_names`)
and otherwise strips a leading ``model.``. MXFP8 ``scale_inv`` statistics arrive as E8M0 codes
(``pytorch/tensor/mxfp8_tensor.py`` keeps ``_rowwise_scale_inv`` as uint8; TE's
``add_scale_inv_stats`` takes their raw min/max): they are stored as the floats ``2**(code - 127)``.

nvdlfw_inspect keeps its state in process globals; this module adds none.
"""

from __future__ import annotations

import math
import re
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fp8track.errors import ConfigError
from fp8track.monitoring import naming
from fp8track.monitoring.records import MetricsRecord, RunWriter, TensorStatsRow
from fp8track.numerics.formats import TENSOR_KINDS
from fp8track.trackers.base import StepBatch
from fp8track.trackers.fanout import TrackerFanout

try:
    from nvdlfw_inspect.logging import BaseLogger
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "fp8track.trackers.nvdlfw needs nvdlfw_inspect (Transformer Engine's debug API): "
        "pip install nvdlfw-inspect"
    ) from exc

TE_TENSORS = ("activation", "gradient", "weight", "output", "dgrad", "wgrad")
"""Tensor names TE's debug features use (``output``/``dgrad``/``wgrad`` are GEMM outputs)."""

TE_STAT_NAMES = {
    "underflows%": "underflow_pct",
    "overflows%": "overflow_pct",
    "cur_amax": "amax",
    "dynamic_range": "dynamic_range_log2",
}
"""TE statistic -> fp8track statistic, where the names differ (others are kept)."""

TE_RECIPE_VARIANTS = {
    "fp8_delayed_scaling": "delayed",
    "fp8_current_scaling": "current",
    "fp8_block_scaling": "block",
    "mxfp8": "mxfp8",
    "nvfp4": "nvfp4",
}
"""TE what-if recipe prefix -> fp8track variant name (fp8track recipe names)."""

_NAME_RE = re.compile(r"^(?P<layer>.+)_(?P<tensor>" + "|".join(TE_TENSORS) + r")_(?P<stat>.+)$")
# Longest prefix first: "fp8_delayed_scaling" must not be read as an unprefixed stat.
_PREFIX_RE = re.compile(
    r"^(?P<recipe>" + "|".join(sorted(TE_RECIPE_VARIANTS, key=len, reverse=True)) + r")_(?P<rest>.+)$"
)


@dataclass(frozen=True)
class TEStat:
    """One parsed TE statistic name."""

    layer: str
    tensor: str
    stat: str
    variant: str = "actual"


def parse_te_stat_name(name: str) -> TEStat | None:
    """Split ``{layer}_{tensor}_{[recipe_]stat[_columnwise]}``; None if no TE tensor name occurs.

    The layer may itself contain underscores; the last ``_<tensor>_`` in the name separates it.

    Example:
        >>> parse_te_stat_name("model.layers.3.mlp.fc1_gradient_underflows%")
        TEStat(layer='model.layers.3.mlp.fc1', tensor='gradient', stat='underflow_pct', variant='actual')
        >>> parse_te_stat_name(
        ...     "blocks.0.layernorm_qkv_activation_mxfp8_scale_inv_min_columnwise"
        ... )  # doctest: +NORMALIZE_WHITESPACE
        TEStat(layer='blocks.0.layernorm_qkv', tensor='activation', stat='scale_inv_min',
               variant='mxfp8_columnwise')
    """
    m = _NAME_RE.match(name)
    if m is None:
        return None
    stat = m["stat"]
    variant = "actual"
    p = _PREFIX_RE.match(stat)
    if p is not None:
        variant = TE_RECIPE_VARIANTS[p["recipe"]]
        stat = p["rest"]
    if stat.endswith("_columnwise"):
        stat = stat[: -len("_columnwise")]
        variant = f"{variant}_columnwise"
    stat = TE_STAT_NAMES.get(stat, stat)
    return TEStat(layer=m["layer"], tensor=m["tensor"], stat=naming.sanitize_segment(stat), variant=variant)


TE_DEBUG_PREFIX = "model."
"""Prefix ``nvdlfw_inspect.api.infer_and_assign_layer_names`` gives every layer name."""


def te_layer_names(model: Any) -> dict[str, str]:
    """``{TE debug name: fp8track row name}`` for every TE GEMM of ``model``: the module's ``name``
    (as TE or ``infer_and_assign_layer_names`` set it) plus ``.fc1``/``.fc2``/``.gemm_<i>``, mapped
    to ``<qualified name>`` plus the same suffix."""
    from fp8track.execution.backends.te import te_gemm_suffixes

    out: dict[str, str] = {}
    for fqn, module in model.named_modules():
        name = getattr(module, "name", None)
        if not isinstance(name, str) or not name:
            continue
        for suffix in te_gemm_suffixes(module):
            out[name + suffix] = fqn + suffix
    return out


def join_layer_name(debug_name: str, names: dict[str, str] | None = None) -> str:
    """The monitor's row name for a TE debug layer name (see the module docstring)."""
    if names and debug_name in names:
        return names[debug_name]
    return debug_name[len(TE_DEBUG_PREFIX) :] if debug_name.startswith(TE_DEBUG_PREFIX) else debug_name


def e8m0_to_float(code: float) -> float:
    """An E8M0 scale code as the float it encodes: ``2**(code - 127)`` (127 = 1.0; 255 = NaN)."""
    c = round(code)
    return math.nan if c == 255 else math.ldexp(1.0, c - 127)


def _to_float(value: Any) -> float:
    """TE hands 0-dim (often CUDA) tensors or Python numbers; this is the one host copy."""
    if hasattr(value, "item"):
        value = value.item()
    return float(value)


def scalar_name(parsed: TEStat) -> str | None:
    """The tracker scalar for a parsed stat: ``fp8/<layer>/<tensor>/<stat>`` for the training
    recipe (``fp8/<layer>/<tensor>/<variant>_<stat>`` for what-if variants); None for tensors
    fp8track does not track as scalars (``output``, ``dgrad``, ``wgrad``: table only)."""
    if parsed.tensor not in TENSOR_KINDS:
        return None
    stat = parsed.stat if parsed.variant == "actual" else f"{parsed.variant}_{parsed.stat}"
    return naming.metric_name(parsed.layer, parsed.tensor, stat)


class TEStatsBridge(BaseLogger):
    """``statistics_logger`` for ``nvdlfw_inspect.api.initialize`` feeding fp8track.

    Values of one iteration are collected; when a value of a later iteration arrives (or
    :meth:`flush` is called, e.g. right after ``debug_api.step()`` or at the end of training),
    the collected step is handed to ``sink`` as one :class:`StepBatch`. Names that are not TE
    stat names are kept as run-level scalars ``fp8/te/<name>`` (with one warning).

    Args:
        sink: receives each completed step, e.g. ``record_and_log(writer, fanout)``.
        step_offset: added to nvdlfw's iteration to give the trainer step (default 0: use
            ``init_training_step`` to align them instead).
        scalars: also emit ``fp8/<layer>/<tensor>/<stat>`` scalars (False: table rows only, for
            models with many layers; W&B advises < 10k metric names per project).
        model: the model whose TE modules emit the stats: debug names map back to qualified
            names (:func:`te_layer_names`, read again for names not yet known); without it a
            leading ``model.`` is stripped.
        training_recipe: fp8track recipe name of the training run (``"mxfp8"`` makes unprefixed
            ``scale_inv_*`` stats E8M0 codes, converted to floats).

    Example:
        >>> import nvdlfw_inspect.api as debug_api  # doctest: +SKIP
        >>> bridge = TEStatsBridge(record_and_log(writer, fanout))  # doctest: +SKIP
        >>> debug_api.initialize(cfg, feature_dirs=[te_features], statistics_logger=bridge,
        ...                      default_logging_enabled=False)  # doctest: +SKIP
    """

    def __init__(
        self,
        sink: Callable[[StepBatch], None],
        *,
        step_offset: int = 0,
        scalars: bool = True,
        model: Any = None,
        training_recipe: str | None = None,
    ) -> None:
        super().__init__()
        if not callable(sink):
            raise ConfigError(f"sink must be a callable taking a StepBatch, got {sink!r}")
        self.sink = sink
        self.step_offset = int(step_offset)
        self.scalars = bool(scalars)
        self.model = model
        self.training_recipe = training_recipe
        self._names: dict[str, str] = {}
        self._lock = threading.Lock()
        self._iteration: int | None = None
        self._metrics: dict[str, float] = {}
        self._rows: dict[tuple[str, str, str], dict[str, float]] = {}
        self._warned_unparsed = False
        self.steps_emitted = 0

    def log_scalar(self, name: str, value: float | int, iteration: int, **kwargs: Any) -> None:
        """nvdlfw_inspect's logger interface: one named value at one iteration."""
        value = _to_float(value)
        iteration = int(iteration)
        ready = None
        with self._lock:
            if self._iteration is not None and iteration != self._iteration:
                ready = self._take()
            self._iteration = iteration
            parsed = parse_te_stat_name(name)
            if parsed is None:
                if not self._warned_unparsed:
                    self._warned_unparsed = True
                    warnings.warn(
                        f"fp8track: {name!r} is not a TE '<layer>_<tensor>_<stat>' name; "
                        "kept as fp8/te/<name>",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                self._metrics[naming.run_metric("te", name)] = value
            else:
                parsed = self._joined(parsed)
                if parsed.stat.startswith("scale_inv") and self._is_e8m0(parsed.variant):
                    value = e8m0_to_float(value)
                self._rows.setdefault((parsed.layer, parsed.tensor, parsed.variant), {})[parsed.stat] = value
                key = scalar_name(parsed) if self.scalars else None
                if key is not None:
                    self._metrics[key] = value
        if ready is not None:
            self.sink(ready)

    def _is_e8m0(self, variant: str) -> bool:
        base = variant.removesuffix("_columnwise")
        return base == "mxfp8" or (base == "actual" and self.training_recipe == "mxfp8")

    def _joined(self, parsed: TEStat) -> TEStat:
        if self.model is not None and parsed.layer not in self._names:
            self._names = te_layer_names(self.model)
        layer = join_layer_name(parsed.layer, self._names)
        return parsed if layer == parsed.layer else TEStat(layer, parsed.tensor, parsed.stat, parsed.variant)

    def _take(self) -> StepBatch | None:
        if self._iteration is None or (not self._metrics and not self._rows):
            return None
        step = self._iteration + self.step_offset
        rows = [
            TensorStatsRow(step=step, layer=layer, tensor=tensor, stats=stats, variant=variant)
            for (layer, tensor, variant), stats in self._rows.items()
        ]
        batch = StepBatch(step=step, metrics=dict(self._metrics), tensor_rows=rows)
        self._metrics, self._rows = {}, {}
        self.steps_emitted += 1
        return batch

    def flush(self) -> None:
        """Hand the step being collected to the sink now."""
        with self._lock:
            ready = self._take()
        if ready is not None:
            self.sink(ready)


def record_and_log(writer: RunWriter | None, fanout: TrackerFanout | None) -> Callable[[StepBatch], None]:
    """A sink that appends a batch to the run directory first, then fans it out to trackers."""

    def sink(batch: StepBatch) -> None:
        if writer is not None:
            writer.write_metrics(MetricsRecord(step=batch.step, metrics=dict(batch.metrics)))
            writer.write_tensor_stats(list(batch.tensor_rows))
        if fanout is not None:
            fanout.log(batch)

    return sink
