"""A thread per rank that keeps the ranks of a job in step when one of them fails or hangs.

Collectives cannot carry bad news: a rank that stops with an error leaves its peers waiting in the next
collective until it times out, and a rank that times out cannot see why. The job's key-value store
(the TCPStore torchrun or `init_process_group` already runs) can. Each rank polls it once a second
from a daemon thread, over its own connection:

- `fault`: a rank that stops posts its one-line reason and exit status; every other rank logs the
  same line and exits with the same status at once, so the job ends everywhere alike.
- `query`: a rank whose collective timed out asks every rank to describe itself (`state/<rank>`:
  its collectives from the flight recorder, its step, its main thread), names the ranks that never
  reached the collective, and posts that as the fault.

Keys are namespaced by torchrun's run id and restart count, so an elastic restart starts clean.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist

from titan_train.faults.exit_status import CollectiveHang, EarlyStop
from titan_train.faults.hang_diagnosis import (
    comm_failure_kind,
    describe_hang,
    dump_flight_record,
    flight_record,
    rank_state,
)
from titan_train.faults.status_file import leave_exit_status

logger = logging.getLogger(__name__)

POLL_SECONDS = 1.0
ANSWER_SECONDS = 15.0  # how long a reporting rank waits for its peers' states
LOST_ANSWER_SECONDS = 4 * POLL_SECONDS + 1.0  # the same after a lost peer: live ranks answer within a poll
ACK_SECONDS = 2 * POLL_SECONDS + 3.0  # how long a failing rank waits for its peers to read its line


class PeerWatch:
    """Start with `start()`; `position` tells where training is; `stop()` at the end of a clean run."""

    def __init__(self, *, rank: int, world_size: int, traces: Path | None, traces_prefix: str = "rank_"):
        self.rank, self.world_size = rank, world_size
        self.traces, self.traces_prefix = traces, traces_prefix
        self.position: Callable[[], str] = lambda: "start-up"
        run = os.environ.get("TORCHELASTIC_RUN_ID", "local")
        self.prefix = f"titan/{run}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self.store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            wait_for_workers=False,
            timeout=dt.timedelta(seconds=30),
        )
        self.failing = False  # this rank's main thread reports its own failure: ignore peers'
        self.gone: set[int] = set()  # ranks that did not answer after a lost peer: no one to wait for
        self._answered = False
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="titan-peer-watch", daemon=True)

    def start(self) -> PeerWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()

    # -- the watching thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopped.wait(POLL_SECONDS):
            try:
                if not self._answered and self._has("query"):
                    self._answer()
                if self._has("fault") and not self.failing:
                    self._follow(json.loads(self._get("fault")))
            except Exception as err:  # the store went away: the job is ending anyway
                logger.debug("peer watch stops: %s", err)
                return

    def _answer(self) -> None:
        self._answered = True
        record = flight_record()
        self._set(f"state/{self.rank}", json.dumps(rank_state(self.position(), record)))
        if self.traces is not None:
            dump_flight_record(record, self.traces, self.traces_prefix, self.rank)

    def _follow(self, fault: dict[str, Any]) -> None:
        """Another rank stopped: say why, in its words, and end this process with its exit status."""
        self.store.add(self.prefix + "fault_seen", 1)
        # The logger the failing rank's CLI uses, so that every rank's line reads the same.
        logging.getLogger("titan_train").error("%s", fault["line"])
        for handler in logging.getLogger().handlers:
            handler.flush()
        leave_exit_status(int(fault["code"]))
        os._exit(int(fault["code"]))

    # -- called by the main thread of a failing rank ----------------------------------------------

    def post_failure(self, code: int, line: str) -> None:
        """Tell every rank to stop with `line` and `code` (the first rank to post wins).

        Returns once every other rank has read a fault or posted its own, or after ACK_SECONDS: the
        store may live in this very process (rank 0 hosts it without torchrun's agent store).
        """
        self.failing = True
        try:
            if self.store.add(self.prefix + "fault_posts", 1) == 1:
                self._set("fault", json.dumps({"rank": self.rank, "code": code, "line": line}))
            else:
                self.store.add(self.prefix + "fault_seen", 1)
            deadline = time.monotonic() + ACK_SECONDS
            while time.monotonic() < deadline:
                if self.store.add(self.prefix + "fault_seen", 0) >= self.world_size - 1 - len(self.gone):
                    break
                time.sleep(0.1)
        except Exception as err:
            logger.debug("could not post the failure to the peers: %s", err)

    def explain(self, err: BaseException) -> CollectiveHang | None:
        """For a collective that timed out or lost a peer: ask every rank where it is and name the culprits."""
        kind = comm_failure_kind(err)
        if kind is None:
            return None
        self.failing = True
        record = flight_record()
        states: dict[int, dict[str, Any] | None] = {self.rank: rank_state(self.position(), record, err)}
        traces = None
        if self.traces is not None and dump_flight_record(record, self.traces, self.traces_prefix, self.rank):
            traces = self.traces
        # After a timeout every rank is asked where it is; after a lost peer, the ranks that do not
        # answer within a few polls are the lost ones (the live ones answer from their watch thread).
        try:
            seconds = ANSWER_SECONDS if kind == "timeout" else LOST_ANSWER_SECONDS
            states.update(self._gather_states(states[self.rank], seconds))
        except Exception as store_err:
            logger.debug("could not gather the peers' states: %s", store_err)
        if kind == "peer lost":
            self.gone = {r for r, state in states.items() if state is None}
        return CollectiveHang(describe_hang(self.rank, kind, states, traces))

    def _gather_states(self, mine: dict[str, Any], seconds: float) -> dict[int, dict[str, Any] | None]:
        self._answered = True  # this rank's state is in hand; the thread need not answer
        self._set(f"state/{self.rank}", json.dumps(mine))
        self._set("query", str(self.rank))
        deadline = time.monotonic() + seconds
        waiting = [r for r in range(self.world_size) if r != self.rank]
        while waiting and time.monotonic() < deadline:
            waiting = [r for r in waiting if not self._has(f"state/{r}")]
            time.sleep(0.2)
        others = [r for r in range(self.world_size) if r != self.rank]
        return {r: json.loads(self._get(f"state/{r}")) if self._has(f"state/{r}") else None for r in others}

    # -- store access -----------------------------------------------------------------------------

    def _has(self, key: str) -> bool:
        return self.store.check([self.prefix + key])

    def _get(self, key: str) -> str:
        return self.store.get(self.prefix + key).decode()

    def _set(self, key: str, value: str) -> None:
        self.store.set(self.prefix + key, value)


def start_peer_watch(rank: int, world_size: int, traces: Path | None, prefix: str) -> PeerWatch | None:
    """A started PeerWatch for multi-rank jobs (None for one rank, or where the store cannot be reached)."""
    if world_size < 2 or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return None
    try:
        return PeerWatch(rank=rank, world_size=world_size, traces=traces, traces_prefix=prefix).start()
    except Exception as err:
        logger.warning("peer watch not started (%s): a failing rank will leave the others waiting", err)
        return None


@contextmanager
def watching_peers(
    rank: int,
    world_size: int,
    traces: Path | None,
    prefix: str,
    exit_status: Callable[[BaseException], tuple[int, str]],
) -> Iterator[PeerWatch | None]:
    """Run the body with a PeerWatch; a failure in it is explained (hangs) and posted to the other ranks.

    `exit_status(err)` gives the exit status and the one line a rank stopping with `err` prints.
    Stops that every rank reaches together (preemption, non-finite numbers) are not posted.
    """
    watch = start_peer_watch(rank, world_size, traces, prefix)
    try:
        yield watch
    except BaseException as err:
        if watch is None:
            raise
        stop = watch.explain(err)
        if stop is None and isinstance(err, EarlyStop):
            raise
        watch.post_failure(*exit_status(stop or err))
        if stop is not None:
            raise stop from None
        raise
    finally:
        if watch is not None:
            watch.stop()
