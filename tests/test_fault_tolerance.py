"""torchft replica groups on this CPU with gloo: a lighthouse, 2 groups of 2 ranks, one rank SIGKILLed.

The drill (tests/ft_drill.py): group 1's rank 1 is killed after step KILL_STEP; group 0 trains on without a
restart, committing its steps with a quorum of 1; torchrun restarts group 1, which heals from group 0 and
from then on both groups hold bit-identical weights and optimizer state (a hash per rank,
`ReplicaGroup.record_digest`). bench/ft_drill.py runs three trials with different kill steps.
(Bad [fault_tolerance] input: packages/titan-train/tests/test_fault_tolerance_config.py.)
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from ft_drill import ALONE, run_drill  # noqa: E402

KILL_STEP, STEPS = 8, 20


@pytest.mark.slow
def test_a_killed_replica_group_heals_from_the_live_one_and_both_end_bit_identical(tmp_path):
    """Planted: the live group sending the weights and optimizer tensors it copied for the first heal (a
    stale copy) instead of current ones fails this test (the digests differ); a stale copy of the whole
    state, its step included, fails it too (the groups never share a quorum again)."""
    drill = run_drill(tmp_path, KILL_STEP, STEPS)
    live, healed = drill.groups
    assert [live.status, healed.status] == [0, 0], (live.log[-3000:], healed.log[-3000:])

    # Group 0 was never restarted and lost no step: every step once, committed.
    assert live.log.count("titan_train.trainer: model ") == 2  # one life of its 2 ranks
    assert sorted(live.records) == list(range(1, STEPS + 1))
    assert any(r["ft_quorum_size"] == 2 for s, r in live.records.items() if s <= KILL_STEP)  # they met first
    alone = [s for s, r in live.records.items() if s > KILL_STEP and r["ft_quorum_size"] == 1]
    assert len(alone) >= ALONE, {s: r["ft_quorum_size"] for s, r in live.records.items()}
    assert live.records[STEPS]["ft_steps_missed"] == 0

    # Group 1 came back (torchrun's restart), healed from group 0 at a later step, then trained in its quorum.
    assert healed.log.count("titan_train.trainer: model ") == 4  # two lives of 2 ranks
    assert drill.heal_line(), healed.log[-3000:]
    last = healed.records[STEPS]
    assert last["ft_heals"] >= 1 and last["ft_heal_bytes"] > 0 and last["ft_steps_missed"] > 0
    assert last["ft_quorum_size"] == live.records[STEPS]["ft_quorum_size"] == 2

    # From the heal on both groups hold the same state, bit for bit, on each rank (different shards per rank).
    assert live.digests[0][0] == healed.digests[0][0] == STEPS
    assert live.digests[0][1] != live.digests[1][1]
    assert drill.identical, (live.digests, healed.digests)
