"""Watching a training run: hooks on GEMM layers, sampling and the cross-rank reduction, the
append-only run directory and metric names. Defines the analyzer and sink interfaces it calls."""
