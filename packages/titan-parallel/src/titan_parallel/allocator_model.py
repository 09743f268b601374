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
    """Blocks of one segment as sorted offsets, each with its size and whether it is free.

    Its free blocks are also entries (size, segment id, offset) of its pool's sorted `free` list, so
    the best fit is found by bisection: the smallest block that fits, the oldest segment's first.
    """

    def __init__(self, size: int, free: list, ident: int):
        self.size, self.free, self.id = size, free, ident
        self.offsets: list[int] = []
        self.blocks: dict[int, list] = {}
        if size:
            self._add(0, size)

    def _add(self, offset: int, size: int) -> None:
        bisect.insort(self.offsets, offset)
        self.blocks[offset] = [size, True]
        bisect.insort(self.free, (size, self.id, offset))

    def _unfree(self, offset: int) -> None:
        del self.free[bisect.bisect_left(self.free, (self.blocks[offset][0], self.id, offset))]

    def take(self, offset: int, size: int, small: bool) -> None:
        self._unfree(offset)
        block_size = self.blocks[offset][0]
        rest = block_size - size
        if rest >= _MIN_BLOCK if small else rest > _SMALL_SIZE:
            self.blocks[offset] = [size, False]
            self._add(offset + size, rest)
        else:
            self.blocks[offset][1] = False

    def give_back(self, offset: int) -> None:
        size = self.blocks[offset][0]
        i = bisect.bisect_left(self.offsets, offset)
        if i + 1 < len(self.offsets) and self.blocks[self.offsets[i + 1]][1]:
            nxt = self.offsets.pop(i + 1)
            self._unfree(nxt)
            size += self.blocks.pop(nxt)[0]
        if i > 0 and self.blocks[self.offsets[i - 1]][1]:
            prev = self.offsets[i - 1]
            self._unfree(prev)
            size += self.blocks[prev][0]
            del self.blocks[self.offsets.pop(i)]
            offset = prev
        self.blocks[offset] = [size, True]
        bisect.insort(self.free, (size, self.id, offset))

    def grow(self, by: int) -> None:
        last = self.offsets[-1] if self.offsets else None
        if last is not None and self.blocks[last][1] and last + self.blocks[last][0] == self.size:
            self._unfree(last)
            self.blocks[last][0] += by
            bisect.insort(self.free, (self.blocks[last][0], self.id, last))
        else:
            self._add(self.size, by)
        self.size += by

    def tail_free(self) -> int:
        if not self.offsets:
            return 0
        last = self.offsets[-1]
        size, free = self.blocks[last]
        return size if free and last + size == self.size else 0

    def all_free(self) -> bool:
        return len(self.offsets) == 1 and self.blocks[0][1]

    def release(self) -> None:
        """Out of its pool (its memory goes back to the device): its free block leaves the pool's list."""
        self._unfree(0)
        self.free = [(self.blocks[0][0], self.id, 0)]


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
    free_blocks: dict[tuple[int, bool], list[tuple[int, int, int]]] = {}  # per pool: (size, segment, offset)
    by_id: dict[int, _Segment] = {}
    where: dict[int, tuple[_Segment, int, bool, int]] = {}  # key -> (segment, offset, small, size)
    allocated = reserved = peak_allocated = peak_reserved = 0

    def release_cached() -> None:
        nonlocal reserved
        for pool in segments.values():
            for seg in [s for s in pool if s.all_free()]:
                pool.remove(seg)
                seg.release()
                reserved -= seg.size

    def new_segment(pool_key: tuple[int, bool], size: int) -> _Segment:
        seg = by_id[len(by_id)] = _Segment(size, free_blocks[pool_key], len(by_id))
        return seg

    def allocate(key: int, size: int) -> None:
        nonlocal allocated, reserved
        size = round_size(size)
        small = size <= _SMALL_SIZE
        pool_key = (streams.get(key, 0), small)
        pool = segments.setdefault(pool_key, [])
        free_list = free_blocks.setdefault(pool_key, [])
        i = bisect.bisect_left(free_list, (size,))
        if i == len(free_list):
            if expandable_segments:
                if not pool:
                    pool.append(new_segment(pool_key, 0))
                seg = pool[0]
                page = _SMALL_SEGMENT if small else _LARGE_SEGMENT
                grow = page * math.ceil((size - seg.tail_free()) / page)
                if capacity is not None and reserved + grow > capacity:
                    release_cached()
                seg.grow(grow)
                reserved += grow
                offset = seg.offsets[-1]
            else:
                if capacity is not None and reserved + _segment_size(size) > capacity:
                    release_cached()
                seg = new_segment(pool_key, _segment_size(size))
                pool.append(seg)
                reserved += seg.size
                offset = 0
        else:
            _, ident, offset = free_list[i]
            seg = by_id[ident]
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
