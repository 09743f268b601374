"""Hang reports from flight-recorder records and rank states (the records have the recorder's JSON layout)."""

import pytest

from titan_train.faults.hang_diagnosis import (
    collectives,
    comm_failure_kind,
    describe_hang,
    describe_init_failure,
)


def _entry(seq: int, name: str, created: int, group: str = "default_pg") -> dict:
    return {
        "collective_seq_id": seq,
        "profiling_name": name,
        "pg_id": 0,
        "process_group": ["0", group],
        "is_p2p": False,
        "retired": True,
        "state": "scheduled",
        "time_created_ns": created,
    }


RECORD = {
    "entries": [_entry(11, "gloo:all_reduce", 100), _entry(12, "gloo:all_gather", 200)],
    "pg_status": {"0": {"last_enqueued_collective": "12", "last_completed_collective": "11"}},
}


def test_collectives_reads_the_unfinished_one_the_last_per_group_and_the_latest():
    pending, last, latest = collectives(RECORD)
    assert pending == [{"name": "gloo:all_gather", "seq": 12, "group": "default_pg"}]
    assert last == {"default_pg": [12, "gloo:all_gather"]}
    assert latest == pending[0]
    assert collectives({}) == ([], {}, None)


@pytest.mark.parametrize(
    ("message", "kind"),
    [
        (
            "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation to complete",
            "timeout",
        ),
        ("[gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:34956", "peer lost"),
        (
            "Gloo connectFullMesh failed with [...] timed out connecting: SO_ERROR: Connection refused",
            "peer lost",
        ),
        ("CUDA out of memory", None),
    ],
)
def test_collective_errors_are_told_apart_from_other_errors(message, kind):
    assert comm_failure_kind(RuntimeError(message)) == kind
    assert comm_failure_kind(ValueError(message)) is None
    assert comm_failure_kind(type("CheckpointError", (RuntimeError,), {})(message)) is None


def test_hang_report_names_the_collective_and_the_rank_that_never_reached_it(tmp_path):
    states = {
        0: {
            "position": "step 2 (forward/backward)",
            "pending": [],
            "latest": {"name": "gloo:all_gather", "seq": 12, "group": "default_pg"},
            "last": {"default_pg": [12, "gloo:all_gather"]},
            "thread": "fsdp.py:1 in f",
        },
        1: {
            "position": "step 2 (forward/backward)",
            "pending": [],
            "latest": None,
            "last": {"default_pg": [11, "gloo:all_reduce"]},
            "thread": "titan_train/data.py:9 in next_batch",
        },
        2: {
            "position": "step 2 (forward/backward)",
            "pending": [{"name": "gloo:all_gather", "seq": 12, "group": "default_pg"}],
            "latest": None,
            "last": {"default_pg": [12, "gloo:all_gather"]},
            "thread": "x",
        },
        3: None,
    }
    line = describe_hang(0, "timeout", states, tmp_path)
    assert line.startswith(
        "hang: rank 0 timed out in gloo:all_gather (collective 12 of process group 'default_pg') at step 2 "
        "(forward/backward); rank 1 never reached it: at step 2 (forward/backward), is at "
        "titan_train/data.py:9 in next_batch, last entered collective 11 (gloo:all_reduce); "
        "rank 3 did not answer"
    )
    assert "rank 2" not in line  # it waits in the same collective
    assert f"flight-recorder dumps in {tmp_path}. Fix: " in line


def test_lost_peer_and_init_failures_read_as_one_line_with_a_fix(monkeypatch):
    states = {
        0: {"position": "step 4 (forward/backward)", "pending": [], "latest": None, "last": {}, "thread": "t"}
    }
    line = describe_hang(0, "peer lost", states, None)
    assert line.startswith(
        "peer lost: rank 0 lost the connection to a peer process during a collective at step 4"
    )
    # Asked where they are, ranks 2 and 3 (on a node that went down) never answered; rank 1 did.
    states.update({1: states[0], 2: None, 3: None})
    assert (
        "ranks 2, 3 are gone (their processes died or were killed, or their node is down)"
        in describe_hang(0, "peer lost", states, None)
    )
    assert "rank 3 is gone" in describe_hang(0, "peer lost", {**states, 2: states[0]}, None)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("MASTER_ADDR", "node0")
    monkeypatch.setenv("MASTER_PORT", "29500")
    line = describe_init_failure(
        TimeoutError("Timed out after 31 seconds waiting for clients. 1/8 clients joined."), 30
    )
    assert line.startswith(
        "init: rank 1 could not form the 8-rank process group at node0:29500 within comm.init_timeout_seconds = 30 s "
        "(Timed out after 31 seconds waiting for clients. 1/8 clients joined.). Fix: start every rank"
    )
