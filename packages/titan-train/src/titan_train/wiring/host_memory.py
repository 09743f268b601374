"""Keep freed host memory in the process heap when training on the CPU.

glibc hands out every allocation above its mmap threshold (32 MiB at most) as a fresh mapping and
unmaps it on free, and it trims the top of the heap back to the kernel too. A CPU training step
allocates and frees gigabytes of activations, so each step page-faults them in again: 0.3-0.7 M minor
faults and about 6% of the step time for the debug model at batch 8 x 2048 (bench/RESULTS.md). Turning
both off keeps the pages for the next step, as the CUDA caching allocator does on a GPU. The cost:
the process holds on to its peak host memory until it exits. `TITAN_KEEP_HOST_MEMORY=0` opts out.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

logger = logging.getLogger(__name__)

# mallopt parameters from glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
INT_MAX = 2**31 - 1


def keep_freed_host_memory() -> bool:
    """Stop glibc from unmapping freed blocks and trimming the heap; True when it took effect."""
    if os.environ.get("TITAN_KEEP_HOST_MEMORY", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False  # not glibc: nothing of this kind to tune
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; musl's stub returns 0 and changes nothing.
    applied = mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, INT_MAX) == 1
    if applied:
        logger.info("host memory: freed blocks stay in the heap (no per-step page faults on CPU)")
    return applied
