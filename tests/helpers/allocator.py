"""glibc's heap kept rather than returned to the kernel after every large free, in the tests' own
processes and every process they start.

Why: CPU PyTorch allocates each op's output with ``malloc``. With glibc's defaults, freeing the
temporaries of one step leaves more than the trim threshold (128 KiB, raised only to twice the
largest mmapped chunk freed so far) free at the top of the heap, so glibc gives it back to the
kernel, and the next step faults every page in again. One statistics call on a 65,536-element
tensor took 712-1,052 minor page faults and 2.2-3.6 ms of system time; with the thresholds below,
0-10 faults and half the wall time; a 160-step monitored training of the diagnosis benchmark
14-27 % less CPU (interleaved runs). Nothing a test asserts depends on the allocator: this is
what PyTorch's CPU tuning guide does with jemalloc or tcmalloc, with no extra dependency. GPUs
never see it (the CUDA caching allocator keeps its blocks).
"""

from __future__ import annotations

import ctypes
import os

TRIM_THRESHOLD = 128 << 20
"""Bytes free at the top of the heap before glibc returns them (default 128 KiB)."""
MMAP_THRESHOLD = 32 << 20
"""Allocations from this size get their own mapping (glibc's largest allowed value on 64-bit)."""

_M_TRIM_THRESHOLD = -1  # <malloc.h>
_M_MMAP_THRESHOLD = -3


def keep_freed_heap() -> None:
    """Apply the thresholds to this process (``mallopt``) and export them for child processes
    (glibc reads ``MALLOC_*_`` at start-up); a value the user exported is kept. No-op off glibc."""
    trim = int(os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(TRIM_THRESHOLD)))
    mmap = int(os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD)))
    libc = ctypes.CDLL(None)  # the symbols already loaded (no ldconfig subprocess, as find_library runs)
    if hasattr(libc, "mallopt"):  # glibc (macOS's libc has none)
        libc.mallopt(_M_TRIM_THRESHOLD, trim)
        libc.mallopt(_M_MMAP_THRESHOLD, mmap)
