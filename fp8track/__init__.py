"""fp8track: diagnose FP8 training against its BF16 control; log the evidence to W&B and MLflow.

Public surface: the names in ``__all__`` (grouped below). Everything else is internal and may
change. Heavier entry points (the Lightning callback, the monitor, trackers, analysis) load on
first attribute access, so ``import fp8track`` stays cheap and never imports Transformer Engine,
torchao, wandb or mlflow.
"""

from __future__ import annotations

import importlib
from typing import Any

from fp8track.errors import ConfigError
from fp8track.execution.recipes import RECIPE_NAMES, Recipe
from fp8track.numerics.stats import STAT_NAMES, block_quant_stats, quant_stats

# Loaded on first attribute access (name -> module).
_LAZY = {
    # the Lightning callback, the plain-PyTorch monitor and their configuration
    "FP8Monitor": "fp8track.lightning",
    "FP8TrainerCallback": "fp8track.hf",
    "Monitor": "fp8track.frontend",
    "MonitorConfig": "fp8track.config",
    "SpikeConfig": "fp8track.analysis.spikes",
    "DivergenceConfig": "fp8track.analysis.divergence",
    "DriftConfig": "fp8track.analysis.drift",
    "run_summary": "fp8track.frontend",
    # running a model in FP8
    "apply_fp8": "fp8track.execution.apply",
    "ApplyReport": "fp8track.execution.apply",
    # the diagnosis of an FP8 run against its BF16 control
    "diagnose": "fp8track.report.run",
    "DiagnosisConfig": "fp8track.analysis.diagnose",
    # the BF16 control
    "load_baseline": "fp8track.analysis.baseline",
    "Baseline": "fp8track.analysis.baseline",
    # run directories and trackers
    "RunReader": "fp8track.monitoring.records",
    "Tracker": "fp8track.trackers",
    "make_trackers": "fp8track.trackers",
    "sync_run": "fp8track.trackers",
    "replay": "fp8track.trackers",  # deprecated: sync_run's former name, kept for one release
    "WandbTracker": "fp8track.trackers.wandb",
    "MLflowTracker": "fp8track.trackers.mlflow",
}

# The public surface. Internal on purpose (import them from their modules): the mergeable
# statistics partials and the compile switch (fp8track.numerics.stats), the detectors
# (fp8track.analysis.*), the run writer (fp8track.monitoring.records), the backends
# (fp8track.execution.backends) and the core monitor (fp8track.monitoring.monitor).
__all__ = [
    # Lightning callback, Hugging Face Trainer callback, plain-PyTorch monitor, configuration
    "FP8Monitor",
    "FP8TrainerCallback",
    "Monitor",
    "MonitorConfig",
    "SpikeConfig",
    "DivergenceConfig",
    "DriftConfig",
    "run_summary",
    # execution: recipes and apply_fp8
    "Recipe",
    "RECIPE_NAMES",
    "apply_fp8",
    "ApplyReport",
    # the diagnosis of an FP8 run against its BF16 control (the headline feature)
    "diagnose",
    "DiagnosisConfig",
    # the BF16 control
    "load_baseline",
    "Baseline",
    # run directories and trackers
    "RunReader",
    "Tracker",
    "make_trackers",
    "sync_run",
    "WandbTracker",
    "MLflowTracker",
    # statistics of one tensor (docs/statistics.md)
    "quant_stats",
    "block_quant_stats",
    "STAT_NAMES",
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
