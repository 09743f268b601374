"""`titan-train check --ngpu N`: a config and its layout checked for N ranks before a launcher starts.

torchrun starts N processes that each find the same mistake, print it, and exit; torchrun then adds
its own ChildFailedError traceback and exits 1. Checked once, in one process, before any launcher
runs, a config or layout error is one line and exit status 2. `apps/run_train.sh` runs it before
torchrun; any launch script can (with N the job's total number of ranks).
"""

from __future__ import annotations

import argparse
import logging

import torch

from titan_train.comm_backend import check_comm_backend
from titan_train.config import load_job_config
from titan_train.config.run_checks import check_run
from titan_train.plan import RunPlan, resolve

logger = logging.getLogger(__name__)

DESCRIPTION = (
    "Check a config and its parallel layout for N ranks without starting them: every config field, the "
    "degrees against N, the model against the degrees (heads, layers, sequence), the batch, settings "
    "this machine's device cannot run, COMM_BACKEND, and a Hugging Face checkpoint to load against the "
    "flavor. A problem is one line and exit status 2; a good config exits 0. apps/run_train.sh runs it before "
    "torchrun; in another launch script (SLURM, say) run it once before the launcher with N = nodes * "
    "GPUs per node. Other flags are config overrides."
)


def check_launch(config, world_size: int) -> RunPlan:
    """The plan of `world_size` ranks, or the user error (one line) that would stop them at start."""
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    check_run(config, world_size=world_size, device_type=device_type)
    check_comm_backend(config, device_type)
    return resolve(config, world_size, device_type)


def check_main(argv: list[str]) -> int:
    """`titan-train check --ngpu N [overrides]`: 0 when the config and layout fit N ranks; errors raise."""
    parser = argparse.ArgumentParser(prog="titan-train check", description=DESCRIPTION)
    parser.add_argument("--ngpu", type=int, required=True, help="ranks the job will run (all nodes)")
    args, rest = parser.parse_known_args(argv)
    config = load_job_config(rest, check_paths=True)
    check_launch(config, args.ngpu)
    logger.info("check: the config and its layout fit %d rank%s", args.ngpu, "" if args.ngpu == 1 else "s")
    return 0
