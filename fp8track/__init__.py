"""fp8track: diagnose FP8 training against its BF16 control; log the evidence to W&B and MLflow.

Public surface (everything else is internal and may change):
"""

from fp8track.errors import ConfigError
from fp8track.formats import E4M3, E5M2, FP8Format, get_format
from fp8track.stats import STAT_NAMES, block_quant_stats, quant_stats

__all__ = [
    # numerics
    "quant_stats",
    "block_quant_stats",
    "STAT_NAMES",
    "FP8Format",
    "E4M3",
    "E5M2",
    "get_format",
    # errors
    "ConfigError",
]

__version__ = "0.1.0"
