"""Settings the trainer cannot honour yet stop the run before it starts, naming the setting and the fix."""

import importlib.util
import logging
from pathlib import Path

import pytest
import torch.distributed as dist

from titan_train.cli import run
from titan_train.config import load_job_config
from titan_train.config.unsupported import UnsupportedConfigError, refuse_unsupported
from titan_train.errors import ConfigError

FIXTURES = Path(__file__).parent / "fixtures"
RUNNABLE = ("--activation_checkpoint.mode", "none")


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--fault_tolerance.enable"], "torchft fault tolerance is not supported"),
        (["--comm.mode", "local_tensor"], "simulating every rank in one process is not supported"),
        (
            ["--parallelism.expert_parallel_comm_backend", "deepep"],
            "DeepEP's all-to-all kernels are not wired",
        ),
        (["--profiling.enable_memory_snapshot"], "memory snapshots record the CUDA caching allocator"),
    ],
)
def test_unwired_settings_are_refused_with_the_fix(flags, message):
    with pytest.raises(UnsupportedConfigError, match=message):
        refuse_unsupported(load_job_config([*RUNNABLE, *flags]), "cpu")


@pytest.mark.parametrize("converter", ["quantize.grouped_mm.float8", "quantize.grouped_mm.mx"])
def test_grouped_mm_converters_are_refused_in_one_line(converter):
    with pytest.raises(ConfigError, match=f"model.converters has '{converter}', which is not one of"):
        load_job_config([*RUNNABLE, "--model.converters", converter])


def test_supported_settings_pass():
    refuse_unsupported(load_job_config([*RUNNABLE, "--training.global_batch_size", "64"]), "cpu")


def test_grouped_mm_settings_are_inert_without_their_converter():
    """As torchtitan reads them (its own MoE debug configs list experts with no converter switched on)."""
    flags = ["--quantize.grouped_mm.float8.fqns", "experts", "--quantize.grouped_mm.mx.fqns", "experts"]
    refuse_unsupported(load_job_config([*RUNNABLE, *flags]), "cpu")

    ep = ["--parallelism.expert_parallel_degree", "2", "--parallelism.expert_tensor_parallel_degree", "2"]
    refuse_unsupported(load_job_config([*RUNNABLE, *ep]), "cpu")
    per_op = [
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "op",
    ]
    refuse_unsupported(load_job_config([*RUNNABLE, *ep, *per_op]), "cpu")  # per-op checkpointing with ep


def test_wandb_without_the_package_says_how_to_install_it(monkeypatch):
    config = load_job_config([*RUNNABLE, "--metrics.enable_wandb"])
    refuse_unsupported(config, "cpu")  # installed in the workspace: accepted
    find_spec = importlib.util.find_spec
    # An environment without it: the import system finds no wandb.
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a)
    )
    with pytest.raises(UnsupportedConfigError, match="wandb package is not installed; pip install wandb"):
        refuse_unsupported(config, "cpu")


def test_the_command_exits_with_the_message_before_joining_a_process_group(caplog, tmp_path):
    code = run([*RUNNABLE, "--job.dump_folder", str(tmp_path), "--fault_tolerance.enable"])
    assert code == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors and "fault_tolerance.enable = true" in errors[0] and "set it to false" in errors[0]
    assert not dist.is_initialized()
