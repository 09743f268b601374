"""What a rank can tell about a hang: its collectives (flight recorder), its position and its main thread.

A collective that times out only tells the waiting rank that *some* peer did not come. Each rank
therefore describes itself (`rank_state`): the collective it waits in, the last collective it entered
per process group, the training step, and where its main thread is. `describe_hang` compares the
states of all ranks and names the ones that never reached the collective, and what they are doing.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

_TIMEOUT_MARKERS = ("timed out", "timeout")
_PEER_LOST_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "connection refused",
)


def comm_failure_kind(err: BaseException) -> str | None:
    """'timeout' or 'peer lost' for an error a collective raised, else None.

    gloo raises plain RuntimeErrors (NCCL DistErrors); subclasses such as a library's own error type
    are someone's deliberate message, not a transport failure.
    """
    if type(err) is not RuntimeError and not isinstance(err, dist.DistError):
        return None
    text = str(err).lower()
    if any(marker in text for marker in _PEER_LOST_MARKERS):
        return "peer lost"
    if any(marker in text for marker in _TIMEOUT_MARKERS):
        return "timeout"
    return None


def flight_record() -> dict[str, Any]:
    """This process's flight recorder (empty when it is off: comm.trace_buf_size = 0)."""
    c10d = torch._C._distributed_c10d
    try:
        if torch.cuda.is_available() and hasattr(c10d, "_dump_nccl_trace_json"):
            return json.loads(c10d._dump_nccl_trace_json(True, False))
        return json.loads(c10d._dump_fr_trace_json(True, False))
    except Exception as err:  # a recorder that is off or unavailable only makes the report shorter
        logger.debug("no flight record: %s", err)
        return {}


def _group_name(entry: dict[str, Any]) -> str:
    name, desc = (entry.get("process_group") or ["?", ""])[:2]
    return desc or name


def collectives(record: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, list[Any]], dict | None]:
    """(collectives entered but not completed, {group: [last sequence number entered, its name]}, the latest).

    A collective that failed counts as completed once its error is out, so a rank that reports its own
    timeout names the latest collective it entered instead.
    """
    unfinished: dict[str, int] = {}
    for pg_id, status in (record.get("pg_status") or {}).items():
        enqueued = int(status.get("last_enqueued_collective", -1))
        if enqueued > int(status.get("last_completed_collective", -1)):
            unfinished[str(pg_id)] = int(status.get("last_completed_collective", -1))
    pending, last, latest = [], {}, None
    for entry in record.get("entries", []):
        group = _group_name(entry)
        seq = entry.get("collective_seq_id", 0)
        if entry.get("is_p2p"):
            continue
        if group not in last or seq >= last[group][0]:
            last[group] = [seq, entry.get("profiling_name", "?")]
        described = {"name": entry.get("profiling_name", "?"), "seq": seq, "group": group}
        completed = unfinished.get(str(entry.get("pg_id")))
        if completed is not None and seq > completed:
            pending.append(described)
        if latest is None or entry.get("time_created_ns", 0) >= latest[0]:
            latest = (entry.get("time_created_ns", 0), described)
    return pending, last, None if latest is None else latest[1]


def main_thread_position(err: BaseException | None = None) -> str:
    """`file.py:123 in func` of the main thread's innermost frame outside torch (plus the torch call it is in).

    Called with the error a rank stops with, the position is where that error was raised.
    """
    if err is not None and err.__traceback__ is not None:
        stack = traceback.extract_tb(err.__traceback__)
    else:
        frame = sys._current_frames().get(threading.main_thread().ident)
        if frame is None:
            return "unknown"
        stack = traceback.extract_stack(frame)
    torch_dir = os.path.dirname(torch.__file__)
    own = next((f for f in reversed(stack) if not f.filename.startswith(torch_dir)), stack[-1])
    where = f"{_short(own.filename)}:{own.lineno} in {own.name}"
    if stack[-1] is not own:
        where += f" (inside torch's {stack[-1].name})"
    return where


def _short(filename: str) -> str:
    """A module's path from its top-level package (`titan_train/faults/drills.py`); else folder and file."""
    path = Path(filename)
    top = path.parent
    while (top / "__init__.py").is_file():
        top = top.parent
    if top == path.parent:
        return "/".join(path.parts[-2:])
    return path.relative_to(top).as_posix()


def rank_state(position: str, record: dict[str, Any], err: BaseException | None = None) -> dict[str, Any]:
    """This rank's self-description for a hang report (JSON-serialisable); `err`: the error it stops with."""
    pending, last, latest = collectives(record)
    return {
        "position": position,
        "pending": pending,
        "last": last,
        "latest": latest,
        "thread": main_thread_position(err),
    }


def dump_flight_record(record: dict[str, Any], folder: Path, prefix: str, rank: int) -> Path | None:
    """Write the record as `folder/<prefix><rank>.json` for offline analysis; None if there is none."""
    if not record:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{prefix}{rank}.json"
    path.write_text(json.dumps(record, indent=1))
    return path


def describe_hang(rank: int, kind: str, states: dict[int, dict[str, Any] | None], traces: Path | None) -> str:
    """One line: which collective `rank` waited in, which ranks never reached it, and what they do instead."""
    mine = states[rank] or {}
    waiting = (mine.get("pending") or [mine.get("latest")])[-1]
    where = f"; flight-recorder dumps in {traces}" if traces else ""
    if kind == "peer lost":
        during = (
            f" {waiting['name']} (collective {waiting['seq']} of '{waiting['group']}')"
            if waiting
            else " a collective"
        )
        gone = [other for other, state in sorted(states.items()) if other != rank and state is None]
        if gone:  # the ranks asked where they are that did not answer: dead, or on a node that is down
            if len(gone) == 1:
                cause = f"rank {gone[0]} is gone (its process died or was killed, or its node is down)"
            else:
                ranks = ", ".join(map(str, gone))
                cause = f"ranks {ranks} are gone (their processes died or were killed, or their node is down)"
        else:
            cause = "that process died or was killed"
        return (
            f"peer lost: rank {rank} lost the connection to a peer process during{during} at "
            f"{mine.get('position', '?')}: {cause}{where}. Fix: read the log of the rank "
            "that failed first (torchrun names it); with torchrun --max-restarts the job restarts from its newest "
            "checkpoint"
        )
    if waiting:
        head = (
            f"hang: rank {rank} timed out in {waiting['name']} (collective {waiting['seq']} of process group "
            f"'{waiting['group']}') at {mine.get('position', '?')}"
        )
    else:
        head = f"hang: rank {rank} timed out in a collective at {mine.get('position', '?')}"
    stuck = []
    for other, state in sorted(states.items()):
        if other == rank:
            continue
        if state is None:
            stuck.append(f"rank {other} did not answer (dead, or stuck without releasing Python)")
            continue
        if waiting and _reached(state, waiting):
            continue
        theirs = (state.get("pending") or [None])[-1]
        doing = (
            f"waits in {theirs['name']} (collective {theirs['seq']} of '{theirs['group']}')"
            if theirs
            else f"is at {state['thread']}"
        )
        last = state.get("last", {}).get(waiting["group"]) if waiting else None
        entered = f", last entered collective {last[0]} ({last[1]})" if last else ""
        stuck.append(f"rank {other} never reached it: at {state['position']}, {doing}{entered}")
    if not stuck and waiting:
        stuck.append("every rank reached it: the network or a slow collective exceeded the timeout")
    fix = (
        "look at what the named ranks are doing (their position above, py-spy dump), or raise "
        "comm.train_timeout_seconds if such a step is legitimately slow"
    )
    return f"{head}; " + "; ".join(stuck) + f"{where}. Fix: {fix}"


def _reached(state: dict[str, Any], waiting: dict[str, Any]) -> bool:
    last = state.get("last", {}).get(waiting["group"])
    return bool(last) and last[0] >= waiting["seq"]


def describe_init_failure(err: BaseException, timeout_s: int) -> str:
    """One line for a process group that could not form within comm.init_timeout_seconds."""
    world = os.environ.get("WORLD_SIZE", "?")
    address = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return (
        f"init: rank {os.environ.get('RANK', '?')} could not form the {world}-rank process group at {address} "
        f"within comm.init_timeout_seconds = {timeout_s} s ({detail}). Fix: start every rank (same MASTER_ADDR, "
        "MASTER_PORT and WORLD_SIZE), check that the nodes reach each other on that port, or raise "
        "comm.init_timeout_seconds"
    )
