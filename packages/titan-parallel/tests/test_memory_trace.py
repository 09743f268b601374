"""MemoryTrace on a plain module: exact live bytes, fake equal to real, and the allocator model's rules."""

import contextlib
import random

import pytest
import torch
from torch import nn

from titan_parallel.allocator_model import replay, round_size
from titan_parallel.memory_trace import MemoryTrace

MIB = 2**20


def _trace(fake: bool) -> tuple[int, dict]:
    with torch._subclasses.FakeTensorMode() if fake else contextlib.nullcontext():
        model = nn.Sequential(nn.Linear(64, 256, bias=False), nn.ReLU(), nn.Linear(256, 64, bias=False))
        x = torch.randn(32, 64)
        trace = MemoryTrace()
        with trace:
            trace.track(model.parameters(), "parameters")
            trace.watch_blocks(0, list(model))
            model(x).sum().backward()
            trace.assign("gradients", [p.grad for p in model.parameters()])
            trace.remove_hooks()
        result = trace.result()
    return result.peak, result.breakdown


def test_traced_peak_is_the_live_bytes_and_fake_tensors_trace_the_same():
    peak, breakdown = _trace(fake=False)
    params = (64 * 256 + 256 * 64) * 4
    assert breakdown["parameters"] == params
    # Counted from the shapes (x is tracked by nobody: not counted). The peak is in ReLU's backward: the
    # weights, W2's gradient, the [32, 256] ReLU output it saved, the gradient arriving at it and the one
    # it produces, and the scalar loss with its seed gradient (4 bytes each).
    hidden = 32 * 256 * 4
    assert peak == params + 256 * 64 * 4 + 3 * hidden + 2 * 4
    assert _trace(fake=True) == (peak, breakdown)


def test_allocator_rounds_reuses_and_grows_segments():
    assert round_size(1) == 512 and round_size(513) == 1024
    # Two small blocks share one 2 MiB segment; a large one takes a 20 MiB segment.
    assert replay([(0, 1000), (1, 1000)]).reserved == 2 * MIB
    assert replay([(0, 3 * MIB)]).reserved == 20 * MIB
    assert replay([(0, 30 * MIB)]).reserved == 30 * MIB
    # A freed block is reused by a request that fits.
    assert replay([(0, 30 * MIB), (0, 0), (1, 25 * MIB)]).reserved == 30 * MIB
    # Growing requests fragment fixed segments; an expandable segment grows in place instead.
    growing = [(k, (k + 11) * MIB) for k in range(6)]
    growing = [e for k, e in enumerate(growing) for e in ([e] if k == 0 else [(k - 1, 0), e])]
    fixed, expandable = replay(growing), replay(growing, expandable_segments=True)
    assert fixed.allocated == expandable.allocated == 16 * MIB
    assert expandable.reserved == 20 * MIB < fixed.reserved
    # A full device releases cached segments before it takes a new one.
    assert replay(growing, capacity=40 * MIB).reserved <= 40 * MIB


@pytest.mark.parametrize("expandable", [False, True])
def test_allocated_peak_is_rounded_live_bytes(expandable):
    peaks = replay([(0, 100), (1, 5000), (0, 0), (2, MIB + 1)], expandable_segments=expandable)
    assert peaks.allocated == 5120 + round_size(MIB + 1)


def _random_sequence(seed: int, events: int = 2000) -> tuple[list[tuple[int, int]], dict[int, int]]:
    """Allocations of every size class (small pool, 20 MiB segments, rounded large ones) and frees of
    random live ones, on two streams."""
    rng = random.Random(seed)
    live, sequence = [], []
    for _ in range(events):
        if live and rng.random() < 0.45:
            sequence.append((live.pop(rng.randrange(len(live))), 0))
            continue
        size = rng.choice(
            [
                rng.randint(1, 4096),
                rng.randint(1, MIB),
                rng.randint(MIB, 12 * MIB),
                rng.randint(10 * MIB, 64 * MIB),
            ]
        )
        live.append(len(sequence))
        sequence.append((len(sequence), size))
    return sequence, {key: key % 2 for key, _ in sequence}


def _peak_of_rounded_live_bytes(sequence: list[tuple[int, int]]) -> int:
    """The allocated peak counted directly: the most rounded bytes live at once."""
    live, size_of, peak = 0, {}, 0
    for key, size in sequence:
        if size == 0:
            live -= size_of.pop(key)
        else:
            size_of[key] = round_size(size)
            live += size_of[key]
            peak = max(peak, live)
    return peak


@pytest.mark.parametrize("expandable,capacity", [(False, None), (True, None), (False, 2048), (True, 2048)])
def test_allocator_replay_of_a_long_random_sequence(expandable, capacity):
    """Allocated is the direct count; reserved holds it in whole 2 MiB pages, and a device too small for
    what was cached (2048 MiB) makes the replay release cached segments, so it reserves no more than
    without the limit. (How close reserved is to CUDA's own:
    packages/titan-train/tests/test_memory_against_gpu.py, against an H200's measurements.)"""
    sequence, streams = _random_sequence(0)
    cap = capacity and capacity * MIB
    peaks = replay(sequence, streams, expandable_segments=expandable, capacity=cap)
    assert peaks.allocated == _peak_of_rounded_live_bytes(sequence)
    assert peaks.allocated <= peaks.reserved and peaks.reserved % (2 * MIB) == 0
    if cap:
        assert peaks.reserved <= replay(sequence, streams, expandable_segments=expandable).reserved
