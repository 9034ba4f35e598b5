"""fp8track: diagnose FP8 training against its BF16 control; log the evidence to W&B and MLflow.

Public surface (everything not listed in ``__all__`` is internal and may change). Heavier
entry points (the Lightning callback, backends) are imported on first attribute access so that
``import fp8track`` stays cheap and never imports Transformer Engine.
"""

from __future__ import annotations

import importlib
from typing import Any

from fp8track.errors import ConfigError
from fp8track.formats import E4M3, E5M2, FP8Format, get_format
from fp8track.monitor import Monitor, MonitorConfig
from fp8track.stats import STAT_NAMES, block_quant_stats, quant_stats

_LAZY = {
    "FP8Monitor": "fp8track.lightning",
}

__all__ = [
    # numerics
    "quant_stats",
    "block_quant_stats",
    "STAT_NAMES",
    "FP8Format",
    "E4M3",
    "E5M2",
    "get_format",
    # monitoring
    "Monitor",
    "MonitorConfig",
    "FP8Monitor",
    # errors
    "ConfigError",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fp8track' has no attribute {name!r}")
