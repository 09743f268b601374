"""Process-group set-up: torchrun's environment, or a one-process group when run directly."""

from __future__ import annotations

import datetime as dt
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device


def launched_world_size() -> int:
    """The world size `init_distributed` will join: WORLD_SIZE under torchrun, else 1."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 1
    return int(os.environ["WORLD_SIZE"])


def init_distributed(init_timeout_seconds: int) -> DistInfo:
    """Join the job's process group (NCCL on GPU, gloo on CPU) and pick this rank's device.

    Run without torchrun, it forms a group of one so that every code path (device mesh, DCP) is the
    same as in a multi-process job.
    """
    # Not launched (or launched before in this process, which left RANK and WORLD_SIZE but no address).
    alone = launched_world_size() == 1 and not ("RANK" in os.environ and "MASTER_ADDR" in os.environ)
    if alone:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        timeout = dt.timedelta(seconds=init_timeout_seconds)
        if alone:
            # A group of one needs no rendezvous: an in-process store, so no port that another process
            # could take between choosing it and listening on it.
            dist.init_process_group(
                backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
        else:
            dist.init_process_group(backend=backend, timeout=timeout)
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world_size, device=device)


def configure_flight_recorder(buffer_size: int, folder: Path, prefix: str) -> None:
    """Keep the last `buffer_size` collectives per rank, dumped to `folder/prefix<rank>` on a hang.

    Read by the process group when it is created, so this runs before `init_distributed`; variables
    the user set already win.
    """
    if buffer_size <= 0:
        return
    folder.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(buffer_size))
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(folder / prefix))


def set_collective_timeout(seconds: int) -> None:
    """Shorten every group's timeout (NCCL and gloo) once start-up, which may load slowly, is over.

    The device mesh's groups are created with the start-up timeout too, and FSDP, TP and the
    checkpointer talk over them, so each group gets the new timeout, not only the default one.
    """
    if not dist.is_initialized():
        return
    timeout = dt.timedelta(seconds=seconds)
    # torch >= 2.12 names it dist.set_timeout; 2.11 has only the private form.
    set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
    for group in list(dist.distributed_c10d._world.pg_map):
        try:
            set_timeout(timeout, group)
        except (ValueError, RuntimeError) as err:  # a backend that cannot change it keeps its own
            logger.debug("collective timeout of %s left unchanged: %s", group, err)


def shutdown(*, wait_for_peers: bool = True) -> None:
    """Leave the process group, after the other ranks when `wait_for_peers`.

    A rank that tears the group down while others still talk to it aborts them (gloo); after an
    error, though, the peers may never arrive, so the failing rank leaves at once.
    """
    if dist.is_initialized():
        if torch.cuda.is_available():
            # A run that ends with the caching allocator holding ~98% of the GPU leaves NCCL no room
            # for the few bytes its barrier allocates (seen on an H100: bench/RESULTS.md).
            torch.cuda.empty_cache()
        if wait_for_peers:
            dist.barrier()
        dist.destroy_process_group()
