"""Keep freed host memory in the process heap while CPU training steps run: opt-in, `TITAN_KEEP_HOST_MEMORY=1`.

glibc hands out every allocation above its mmap threshold (32 MiB at most) as a fresh mapping and
unmaps it on free, and it trims the top of the heap back to the kernel too. A CPU training step
allocates and frees gigabytes of activations, so each step page-faults them in again: 0.3-0.7 M minor
faults and about 6% of the step time for the debug model at batch 8 x 2048 (bench/RESULTS.md). Turning
both off keeps the pages for the next step, as the CUDA caching allocator does on a GPU.

It is off by default because what the kept heap holds grows with the order of allocations, not with the
run's needs (issue 63, bench/RESULTS.md): a 4-rank FSDP run of a 1 GB dense model peaked at 2.4 GiB per rank
after its first step and 2.8 after the second and third with glibc's defaults, but 3.8 and 4.2-4.8 with the
heap kept, one rank 0.4-0.65x the model above the median. When it is on, `KeptHostMemory` keeps the heap
only from the second step (the first one allocates the gradients and optimizer states the run holds, and the
start's loads run before it), and `released()` gives glibc's defaults back, the freed heap trimmed, around
the last step's save and export.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import sys
from collections.abc import Iterator

logger = logging.getLogger(__name__)

# mallopt parameters from glibc's malloc.h, and glibc's defaults for them
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
INT_MAX = 2**31 - 1
DEFAULT_TRIM_THRESHOLD = 128 * 1024
DEFAULT_MMAP_MAX = 65536


def wanted() -> bool:
    """Whether the environment asks for the kept heap (`TITAN_KEEP_HOST_MEMORY=1`)."""
    return os.environ.get("TITAN_KEEP_HOST_MEMORY", "0") == "1"


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    except (OSError, AttributeError):
        return None  # not glibc: nothing of this kind to tune
    return libc


def keep_freed_host_memory() -> bool:
    """Stop glibc from unmapping freed blocks and trimming the heap; True when it took effect."""
    libc = _libc()
    # mallopt returns 1 on success; musl's stub returns 0 and changes nothing.
    return (
        libc is not None and libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, INT_MAX) == 1
    )


def release_freed_host_memory() -> bool:
    """glibc's defaults again (large blocks mapped and unmapped, the heap trimmed), and the freed part of
    the heap handed back to the kernel now; True when it took effect."""
    libc = _libc()
    if libc is None:
        return False
    restored = (
        libc.mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX) == 1
        and libc.mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD) == 1
    )
    libc.malloc_trim(0)
    return restored


class KeptHostMemory:
    """The steps' heap policy of a CPU run that asked for it: `keep()` after the first step, `released()`
    around work that allocates model-sized buffers once (the last save and its export), `close()` at the end."""

    def __init__(self, enabled: bool):
        self.enabled, self.kept, self.said = enabled, False, False

    def keep(self) -> None:
        if self.enabled and not self.kept and keep_freed_host_memory():
            self.kept = True
            if not self.said:
                self.said = True
                logger.info(
                    "host memory: freed blocks stay in the heap while steps run (no page faults each step)"
                )

    @contextlib.contextmanager
    def released(self) -> Iterator[None]:
        was_kept = self.kept
        self.close()
        try:
            yield
        finally:
            if was_kept:
                self.keep()

    def close(self) -> None:
        if self.kept:
            release_freed_host_memory()
            self.kept = False
