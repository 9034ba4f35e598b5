"""Reading the records: robust windows, loss spikes, divergence, scale drift and the BF16 control,
adapted to the monitor as analyzers. Never touches tensors or trackers."""

from fp8track.analysis.analyzers import DriftAnalyzer, LossAnalyzer

__all__ = ["LossAnalyzer", "DriftAnalyzer"]
