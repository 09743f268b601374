"""Shared set-up for titan-train's tests: a real one-rank process group and small training configs."""

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from titan_train.config import load_job_config

# Helpers shared by test modules (field_probes) import by name under --import-mode=importlib.
sys.path.insert(0, str(Path(__file__).parent))
from titan_train.distributed import DistInfo

# The debug model at a CPU-friendly size: seq 32, three steps, logged every step.
SMALL = (
    "--training.seq_len",
    "32",
    "--training.steps",
    "3",
    "--activation_checkpoint.mode",
    "none",
    "--metrics.log_freq",
    "1",
    "--metrics.disable_color_printing",
    "--lr_scheduler.warmup_steps",
    "2",
    "--optimizer.lr",
    "3e-3",
)


@pytest.fixture(scope="session")
def small_config():
    """`small_config(dump, *flags)`: the debug model config at test size, writing to `dump`."""

    def make(dump: Path, *overrides: str):
        return load_job_config(["--job.dump_folder", str(dump), *SMALL, *overrides])

    return make


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """A real gloo group of one rank (the trainer builds a device mesh on it), torn down after the module."""
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    dist.destroy_process_group()
