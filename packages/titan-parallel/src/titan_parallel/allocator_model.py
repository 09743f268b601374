"""The CUDA caching allocator replayed on a traced allocation sequence: expected peak reserved bytes.

What a training log calls memory is the allocator's peak reserved: segments it took from the device,
including free space in them that it keeps cached. This follows the rules of PyTorch's
CUDACachingAllocator as documented in its source: sizes round up to 512 bytes; requests up to 1 MiB
come from 2 MiB segments (the small pool), larger ones from 20 MiB segments below 10 MiB and from
segments rounded up to 2 MiB above; a free block is split when what remains is at least 512 bytes
(small) or more than 1 MiB (large); freed blocks merge with free neighbours; the best-fitting free
block of the same stream and pool is reused. With `expandable_segments` each stream and pool has one
segment that grows by mapping pages (2 MiB small, 20 MiB large) at its end. When the device is full,
cached free segments are released and the request retried.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

MIB = 2**20
_MIN_BLOCK = 512
_SMALL_SIZE = MIB
_SMALL_SEGMENT = 2 * MIB
_LARGE_SEGMENT = 20 * MIB
_MIN_LARGE_ALLOC = 10 * MIB
_ROUND_LARGE = 2 * MIB


@dataclass(frozen=True)
class AllocatorPeaks:
    """Peak allocated (block sizes, as `max_memory_allocated`) and peak reserved (as `max_memory_reserved`)."""

    allocated: int
    reserved: int


def round_size(size: int) -> int:
    """The block size the allocator hands out for a request of `size` bytes."""
    return _MIN_BLOCK if size < _MIN_BLOCK else _MIN_BLOCK * math.ceil(size / _MIN_BLOCK)


def _segment_size(size: int) -> int:
    if size <= _SMALL_SIZE:
        return _SMALL_SEGMENT
    if size < _MIN_LARGE_ALLOC:
        return _LARGE_SEGMENT
    return _ROUND_LARGE * math.ceil(size / _ROUND_LARGE)


class _Segment:
    """Blocks of one segment as sorted offsets, each with its size and whether it is free."""

    def __init__(self, size: int):
        self.size = size
        self.offsets = [0]
        self.blocks = {0: [size, True]}

    def take(self, offset: int, size: int, small: bool) -> None:
        block_size = self.blocks[offset][0]
        rest = block_size - size
        if rest >= _MIN_BLOCK if small else rest > _SMALL_SIZE:
            self.blocks[offset] = [size, False]
            self.blocks[offset + size] = [rest, True]
            bisect.insort(self.offsets, offset + size)
        else:
            self.blocks[offset][1] = False

    def give_back(self, offset: int) -> None:
        self.blocks[offset][1] = True
        i = bisect.bisect_left(self.offsets, offset)
        if i + 1 < len(self.offsets) and self.blocks[self.offsets[i + 1]][1]:
            nxt = self.offsets.pop(i + 1)
            self.blocks[offset][0] += self.blocks.pop(nxt)[0]
        if i > 0 and self.blocks[self.offsets[i - 1]][1]:
            prev = self.offsets[i - 1]
            self.blocks[prev][0] += self.blocks.pop(self.offsets.pop(i))[0]

    def grow(self, by: int) -> None:
        last = self.offsets[-1] if self.offsets else None
        if last is not None and self.blocks[last][1] and last + self.blocks[last][0] == self.size:
            self.blocks[last][0] += by
        else:
            self.offsets.append(self.size)
            self.blocks[self.size] = [by, True]
        self.size += by

    def tail_free(self) -> int:
        if not self.offsets:
            return 0
        last = self.offsets[-1]
        size, free = self.blocks[last]
        return size if free and last + size == self.size else 0

    def all_free(self) -> bool:
        return len(self.offsets) == 1 and self.blocks[0][1]


def replay(
    sizes: list[tuple[int, int]],
    streams: dict[int, int] | None = None,
    *,
    expandable_segments: bool = False,
    capacity: int | None = None,
) -> AllocatorPeaks:
    """Peak allocated and reserved bytes for a sequence of (storage key, new size) events (0 frees)."""
    streams = streams or {}
    segments: dict[tuple[int, bool], list[_Segment]] = {}
    where: dict[int, tuple[_Segment, int, bool, int]] = {}  # key -> (segment, offset, small, size)
    allocated = reserved = peak_allocated = peak_reserved = 0

    def release_cached() -> None:
        nonlocal reserved
        for pool in segments.values():
            for seg in [s for s in pool if s.all_free()]:
                pool.remove(seg)
                reserved -= seg.size

    def allocate(key: int, size: int) -> None:
        nonlocal allocated, reserved
        size = round_size(size)
        small = size <= _SMALL_SIZE
        pool = segments.setdefault((streams.get(key, 0), small), [])
        best = None
        for seg in pool:
            for offset in seg.offsets:
                block_size, free = seg.blocks[offset]
                if free and block_size >= size and (best is None or block_size < best[2]):
                    best = (seg, offset, block_size)
        if best is None:
            if expandable_segments:
                if not pool:
                    pool.append(_Segment(0))
                    pool[0].offsets, pool[0].blocks = [], {}
                seg = pool[0]
                page = _SMALL_SEGMENT if small else _LARGE_SEGMENT
                grow = page * math.ceil((size - seg.tail_free()) / page)
                if capacity is not None and reserved + grow > capacity:
                    release_cached()
                seg.grow(grow)
                reserved += grow
                offset = seg.offsets[-1]
            else:
                seg = _Segment(_segment_size(size))
                if capacity is not None and reserved + seg.size > capacity:
                    release_cached()
                pool.append(seg)
                reserved += seg.size
                offset = 0
        else:
            seg, offset, _ = best
        seg.take(offset, size, small)
        where[key] = (seg, offset, small, size)
        allocated += size

    def free(key: int) -> None:
        nonlocal allocated
        seg, offset, _, size = where.pop(key)
        seg.give_back(offset)
        allocated -= size

    for key, size in sizes:
        if key in where:
            free(key)
        if size:
            allocate(key, size)
        peak_allocated = max(peak_allocated, allocated)
        peak_reserved = max(peak_reserved, reserved)
    return AllocatorPeaks(peak_allocated, peak_reserved)
