"""This job as one replica group of a torchft quorum: the replicate dimension across groups.

Each group is its own torchrun job (FSDP, TP, PP, CP, EP inside it as without fault tolerance). Per step,
torchft's `Manager` asks the lighthouse which groups take part (`begin_step`, during the forward pass), the
gradients are averaged over those groups through the Manager's process group (`average_gradients`, after
the group's own reduce-scatter, before clipping), and the optimizer steps only if the Manager says the
step commits (`commit`). A group that joins behind the others is sent the live state (`HealState`) by a
peer and applies it inside `commit`; its own gradients count as zero that step, so afterwards it holds
the live groups' weights and optimizer state bit for bit.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from titan_train.fault_tolerance.heal_state import HealState, local_shard
from titan_train.fault_tolerance.lighthouse import LIGHTHOUSE_ENV
from titan_train.fault_tolerance.semi_sync import semi_sync_training

logger = logging.getLogger(__name__)


@dataclass
class ReplicaCounts:
    """What failures cost this group so far, for the log and metrics.jsonl."""

    quorum_size: int = 0  # replica groups in this step's quorum
    steps_missed: int = 0  # the job's steps this group did not train (skipped over by heals)
    uncommitted_steps: int = (
        0  # steps trained but not committed (a peer failed mid-step): their samples are lost
    )
    heals: int = 0
    heal_seconds: float = 0.0  # the last heal: from the step's quorum to the state applied
    heal_bytes: int = 0  # the last heal's tensors received

    def metrics(self) -> dict[str, float]:
        return {
            "ft_quorum_size": self.quorum_size,
            "ft_steps_missed": self.steps_missed,
            "ft_uncommitted_steps": self.uncommitted_steps,
            "ft_heals": self.heals,
            "ft_heal_seconds": self.heal_seconds,
            "ft_heal_bytes": self.heal_bytes,
        }


class ReplicaGroup:
    """The trainer's one fault-tolerance object: torchft's Manager for this group, and what it costs."""

    def __init__(self, settings, *, rank: int, world_size: int, dump: Path, semi_sync: bool = False):
        import torchft

        self.settings, self.rank, self.dump, self.semi_sync = settings, rank, dump, semi_sync
        timeout = timedelta(milliseconds=settings.process_group_timeout_ms)
        pg_class = torchft.ProcessGroupGloo if settings.process_group == "gloo" else torchft.ProcessGroupNCCL
        self.counts = ReplicaCounts()
        self.heal_state: HealState | None = None
        self._began = 0.0
        self._step_at_begin = 0
        self._healed_bytes = 0
        self._asked = False  # whether this process has asked for a quorum (begin_step)
        # torchft meets the group's ranks in torchrun's store; a run started without torchrun (one rank)
        # gets a store of its own.
        self._store = None
        if "MASTER_ADDR" not in os.environ:
            self._store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
        # Semi-synchronous methods need the quorum settled before the step (torchft's rule); a synchronous
        # step computes it during the forward pass.
        self.manager = torchft.Manager(
            pg=pg_class(timeout=timeout),
            load_state_dict=None,
            state_dict=None,
            min_replica_size=settings.min_replica_size,
            use_async_quorum=not semi_sync,
            replica_id=f"titan_ft_{settings.replica_id}",
            rank=rank,
            world_size=world_size,
            timeout=max(timeout, timedelta(seconds=60)),
            store_addr="localhost" if self._store is not None else None,
            store_port=self._store.port if self._store is not None else None,
            # Every group builds the same initial weights from the run's seed, so the first quorum need not
            # copy them (torchft's advice); a group that joins behind the others still heals.
            init_sync=False,
        )
        logger.info(
            "fault tolerance: replica group %d of %d started its torchft manager (lighthouse at %s)",
            settings.replica_id,
            settings.group_size,
            os.environ.get(LIGHTHOUSE_ENV, ""),
        )

    def data_rank(self, dp_rank: int, dp_degree: int) -> tuple[int, int]:
        """This rank's share of the data among every group's: the groups split the stream as one larger
        data-parallel dimension would."""
        return self.settings.replica_id * dp_degree + dp_rank, self.settings.group_size * dp_degree

    def register(self, heal_state: HealState) -> None:
        """The state a healing peer receives from this group, and this group from a live one."""
        self.heal_state = heal_state
        self.manager.register_state_dict_fn("titan", self._load, heal_state.state_dict)

    def _load(self, state: dict) -> None:
        assert self.heal_state is not None
        self._healed_bytes = self.heal_state.load_state_dict(state)

    def training(self, parts: list[nn.Module], optimizers: list[Optimizer]):
        """The context the loop trains in: LocalSGD's or DiLoCo's optimizer hooks under `semi_sync_method`
        (entered once the weights are restored: DiLoCo keeps them as the first outer step's origin)."""
        return semi_sync_training(self.manager, self.settings, parts, optimizers)

    def begin_step(self) -> None:
        """Ask for this step's quorum; it forms while the forward pass runs (semi-synchronous methods ask
        at their syncs)."""
        if self.semi_sync:
            return
        self._began = time.perf_counter()
        self._step_at_begin = self.manager.current_step()
        self._healed_bytes = 0
        self._asked = True
        if self.counts.quorum_size == 0:  # this process's first step: the group (re)joins the quorum here
            logger.info(
                "fault tolerance: replica group %d asks the lighthouse for its first quorum",
                self.settings.replica_id,
            )
        self.manager.start_quorum()

    def average_gradients(self, parameters: list[nn.Parameter]) -> None:
        """Average this rank's gradient shards over the quorum's groups, one flat buffer per dtype.

        A group that is healing (or a failed all-reduce) leaves zeros, and torchft divides by the groups
        that take part, so the average is over live gradients only."""
        if self.semi_sync:
            return
        grads = [local_shard(p.grad) for p in parameters if p.grad is not None]
        for dtype in sorted({g.dtype for g in grads}, key=str):
            same = [g for g in grads if g.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in same])
            self.manager.allreduce(flat).wait()
            offset = 0
            for g in same:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def commit(self, step: int) -> bool:
        """Whether every rank of this group may step the optimizer for `step` (torchft's should_commit,
        which first applies a heal's state); counts and logs what it cost. Semi-synchronous methods commit
        at their syncs, inside the optimizer's step: every step is taken, the quorum is the last sync's."""
        committed = self.semi_sync or self.manager.should_commit()
        counts = self.counts
        quorum = self.manager.num_participants()
        if quorum != counts.quorum_size:
            logger.info(
                "fault tolerance: step %d has a quorum of %d replica groups (was %d)",
                step,
                quorum,
                counts.quorum_size,
            )
        counts.quorum_size = quorum
        if self._healed_bytes:
            counts.heals += 1
            counts.heal_seconds = time.perf_counter() - self._began
            counts.heal_bytes = self._healed_bytes
            jumped = self.manager.current_step() - int(committed) - self._step_at_begin
            counts.steps_missed += max(0, jumped)
            logger.info(
                "fault tolerance: healed from a live replica group at its step %d (%d steps missed): %.2f s, %d bytes",
                self.manager.current_step() - int(committed),
                max(0, jumped),
                counts.heal_seconds,
                counts.heal_bytes,
            )
        if not committed:
            counts.uncommitted_steps += 1
            logger.warning(
                "fault tolerance: step %d not committed (quorum %d, at least %d needed, or a replica group "
                "failed during it); the step is trained again on the next batch",
                step,
                quorum,
                self.settings.min_replica_size,
            )
        return committed

    def writes_checkpoints(self) -> bool:
        """Whether this group writes the shared full checkpoint now: the group that is rank 0 of the last
        quorum (the same answer on every rank of a group; none while healing). Before the first quorum
        (a seed checkpoint, a semi-synchronous run's steps before its first sync) group 0 writes."""
        rank = self.manager.participating_rank()
        if rank is None:
            return self.settings.replica_id == 0 and (self.semi_sync or not self._asked)
        return rank == 0

    def record_digest(self, step: int) -> str:
        """Log and write (dump/fault_tolerance/digest_rank{r}.json) a hash of this rank's weights and
        optimizer state: two groups' rank r hold the same state exactly when their digests agree."""
        assert self.heal_state is not None
        digest = self.heal_state.digest()
        logger.info(
            "fault tolerance: replica group %d rank %d state digest %s at step %d",
            self.settings.replica_id,
            self.rank,
            digest,
            step,
        )
        folder = self.dump / "fault_tolerance"
        folder.mkdir(parents=True, exist_ok=True)
        record = {"replica_id": self.settings.replica_id, "rank": self.rank, "step": step, "digest": digest}
        (folder / f"digest_rank{self.rank}.json").write_text(json.dumps(record))
        return digest

    def close(self) -> None:
        self.manager.shutdown(wait=False)
