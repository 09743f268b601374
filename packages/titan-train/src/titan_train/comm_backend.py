"""COMM_BACKEND: the library behind collectives on symmetric memory (async tensor parallelism).

`nccl` (the default) leaves torch's own choice. `nvshmem` makes torch allocate symmetric memory with
NVSHMEM (`torch.distributed._symmetric_memory.set_backend("NVSHMEM")`); async tensor parallelism's
fused matmul-collectives then communicate through it. It needs CUDA GPUs, a torch built with NVSHMEM,
the NVSHMEM library (torch 2.15's CUDA 13 wheel depends on `nvidia-nvshmem-cu13`; else `pip install
nvidia-nvshmem-cu12` or `-cu13`, by torch's CUDA version) and a run that uses symmetric memory. Where any is missing the launch stops before any work with one line naming
COMM_BACKEND and exit status 2: a backend accepted and then not used would make a benchmark measure
something else than its label says.

An environment variable rather than a config field because it is the launcher's choice, like NGPU:
`apps/run_train.sh` and `apps/multinode_trainer.slurm` pass it on, and `titan-train check` and every
rank read it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch

from titan_train.config import JobConfig
from titan_train.errors import ConfigError

logger = logging.getLogger(__name__)

ENV = "COMM_BACKEND"
COMM_BACKENDS = ("nccl", "nvshmem")
_FIX = "unset COMM_BACKEND (or set COMM_BACKEND=nccl)"


def comm_backend(environ: Mapping[str, str] = os.environ) -> str:
    """The COMM_BACKEND asked for ("nccl" when unset); an unknown name is refused."""
    name = environ.get(ENV) or "nccl"
    if name not in COMM_BACKENDS:
        raise ConfigError(f"COMM_BACKEND={name} is not one of {', '.join(COMM_BACKENDS)}; {_FIX}")
    return name


def _nvshmem_problem(config: JobConfig, device_type: str) -> str | None:
    """Why NVSHMEM cannot back this run's symmetric memory, or None."""
    if device_type != "cuda":
        return f"NVSHMEM needs CUDA GPUs, and this run's device is {device_type}"
    try:
        from torch.distributed import _symmetric_memory as symm_mem
    except ImportError:
        return f"torch {torch.__version__} has no symmetric memory (torch.distributed._symmetric_memory)"
    if not hasattr(symm_mem, "set_backend"):
        return f"torch {torch.__version__} cannot choose the symmetric-memory backend (torch >= 2.8 can)"
    if not symm_mem.is_nvshmem_available():
        return (
            f"torch {torch.__version__} finds no NVSHMEM (a build without it, or the library missing: "
            "pip install nvidia-nvshmem-cu12, or nvidia-nvshmem-cu13 for a CUDA 13 torch)"
        )
    if not config.parallelism.enable_async_tensor_parallel:
        return (
            "nothing in this run uses symmetric memory; set parallelism.enable_async_tensor_parallel "
            "(with tensor_parallel_degree > 1 and compile)"
        )
    return None


def check_comm_backend(config: JobConfig, device_type: str, environ: Mapping[str, str] = os.environ) -> str:
    """The COMM_BACKEND for a run of `config` on `device_type`; ConfigError where it cannot work."""
    name = comm_backend(environ)
    if name == "nvshmem":
        problem = _nvshmem_problem(config, device_type)
        if problem:
            raise ConfigError(f"COMM_BACKEND=nvshmem: {problem}; {_FIX}")
    return name


def apply_comm_backend(name: str) -> None:
    """Make `name` back symmetric memory; before any symmetric memory is allocated (torch's rule)."""
    if name == "nvshmem":
        from torch.distributed import _symmetric_memory as symm_mem

        symm_mem.set_backend("NVSHMEM")
        logger.info("COMM_BACKEND=nvshmem: symmetric memory (async tensor parallelism) is NVSHMEM's")
