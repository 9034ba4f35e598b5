"""fp8track: diagnose FP8 training against its BF16 control; log the evidence to W&B and MLflow.

Public surface: the names in ``__all__`` (grouped below). Everything else is internal and may
change. Heavier entry points (the Lightning callback, backends, trackers, analysis) load on
first attribute access, so ``import fp8track`` stays cheap and never imports Transformer Engine,
torchao, wandb or mlflow.
"""

from __future__ import annotations

import importlib
from typing import Any

from fp8track.errors import ConfigError
from fp8track.execution.recipes import RECIPE_NAMES, Recipe
from fp8track.monitoring.monitor import MonitorConfig
from fp8track.numerics.formats import E4M3, E5M2, FP8Format, get_format
from fp8track.numerics.stats import (
    STAT_NAMES,
    all_reduce_partials,
    block_partial_stats,
    block_quant_stats,
    finalize,
    merge_partials,
    partial_stats,
    quant_stats,
    set_compile,
)

_LAZY = {
    # frontends
    "FP8Monitor": "fp8track.lightning",
    "Monitor": "fp8track.frontend",
    # execution
    "apply_fp8": "fp8track.execution.apply",
    "ApplyReport": "fp8track.execution.apply",
    "FallbackSpec": "fp8track.execution.fallback",
    "EmulatedFP8Linear": "fp8track.execution.backends.emulated",
    # analysis
    "load_baseline": "fp8track.analysis.baseline",
    "SpikeConfig": "fp8track.analysis.spikes",
    "SpikeDetector": "fp8track.analysis.spikes",
    "DivergenceConfig": "fp8track.analysis.divergence",
    "DivergenceDetector": "fp8track.analysis.divergence",
    "DriftConfig": "fp8track.analysis.drift",
    "DriftTracker": "fp8track.analysis.drift",
    # records and trackers
    "RunReader": "fp8track.monitoring.records",
    "RunWriter": "fp8track.monitoring.records",
    "make_trackers": "fp8track.trackers",
    "replay": "fp8track.trackers",
}

__all__ = [
    # numerics (docs/statistics.md)
    "quant_stats",
    "block_quant_stats",
    "partial_stats",
    "block_partial_stats",
    "merge_partials",
    "all_reduce_partials",
    "finalize",
    "set_compile",
    "STAT_NAMES",
    "FP8Format",
    "E4M3",
    "E5M2",
    "get_format",
    # execution
    "Recipe",
    "RECIPE_NAMES",
    "apply_fp8",
    "ApplyReport",
    "FallbackSpec",
    "EmulatedFP8Linear",
    # monitoring
    "Monitor",
    "MonitorConfig",
    "FP8Monitor",
    # analysis
    "load_baseline",
    "SpikeConfig",
    "SpikeDetector",
    "DivergenceConfig",
    "DivergenceDetector",
    "DriftConfig",
    "DriftTracker",
    # records and trackers
    "RunReader",
    "RunWriter",
    "make_trackers",
    "replay",
    # errors
    "ConfigError",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fp8track' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
