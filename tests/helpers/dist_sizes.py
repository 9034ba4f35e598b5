"""Sizes of the distributed worker scripts (tests/integration/scripts, run as subprocesses), shared
with the tests that recompute their statistics in one process."""

DDP_N, DDP_D_IN, DDP_D_HID, DDP_D_OUT, DDP_BATCH = 64, 32, 48, 16, 8
"""ddp_monitor.py: dataset rows, input, hidden and output widths, per-rank batch."""

SHARDED_D_IN, SHARDED_D_HID, SHARDED_D_OUT, SHARDED_BATCH, SHARDED_STEPS = 32, 64, 16, 8, 3
"""sharded_monitor.py: input, hidden and output widths, per-data-parallel-rank batch, steps."""
SHARDED_LAYERS = ("net.0", "net.2")
"""sharded_monitor.py: its two linears (column-wise, then row-wise under tensor parallelism)."""
