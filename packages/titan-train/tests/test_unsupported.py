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
        (
            [
                "--fault_tolerance.enable",
                "--fault_tolerance.group_size",
                "1",
                "--fault_tolerance.semi_sync_method",
                "diloco",
                "--fault_tolerance.should_quantize",
            ],
            "torchft quantizes with Triton kernels on CUDA only",
        ),
        (
            [
                "--fault_tolerance.enable",
                "--fault_tolerance.group_size",
                "1",
                "--fault_tolerance.process_group",
                "nccl",
            ],
            "NCCL needs CUDA GPUs; use 'gloo'",
        ),
        (["--comm.mode", "local_tensor"], "LocalTensorMode cannot run FSDP2"),
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
    code = run(
        [
            *RUNNABLE,
            "--job.dump_folder",
            str(tmp_path),
            "--parallelism.expert_parallel_comm_backend",
            "deepep",
        ]
    )
    assert code == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors and "expert_parallel_comm_backend = 'deepep'" in errors[0] and "use 'standard'" in errors[0]
    assert not dist.is_initialized()


def test_local_tensor_refusal_names_what_torch_lacks_fsdp2_under_local_tensor_mode(tmp_path):
    """The reason `comm.mode = 'local_tensor'` gives, checked on this torch in a child process (a fake
    group of 2 ranks): tensor parallelism trains under LocalTensorMode, FSDP2's forward and backward fail
    on freeing a parameter's storage. Once torch runs FSDP2 there, this test fails: honour the mode."""
    import subprocess
    import sys

    probe = tmp_path / "probe.py"
    probe.write_text(
        "import sys, torch, torch.distributed as dist\n"
        "from torch import nn\n"
        "from torch.distributed._local_tensor import LocalTensorMode\n"
        "from torch.distributed.device_mesh import init_device_mesh\n"
        "from torch.distributed.fsdp import fully_shard\n"
        "from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module\n"
        "from torch.testing._internal.distributed.fake_pg import FakeStore\n"
        "dist.init_process_group('fake', rank=0, world_size=2, store=FakeStore())\n"
        "m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))\n"
        "with LocalTensorMode(2):\n"
        "    mesh = init_device_mesh('cpu', (2,))\n"
        "    if sys.argv[1] == 'fsdp':\n"
        "        fully_shard(m, mesh=mesh)\n"
        "    else:\n"
        "        parallelize_module(m, mesh, {'0': ColwiseParallel(), '2': RowwiseParallel()})\n"
        "    m(torch.randn(4, 8)).sum().backward()\n"
        "print('trained')\n"
    )
    runs = {
        layout: subprocess.run(
            [sys.executable, str(probe), layout], capture_output=True, text=True, timeout=300
        )
        for layout in ("tp", "fsdp")
    }
    assert runs["tp"].returncode == 0 and "trained" in runs["tp"].stdout, runs["tp"].stderr[-2000:]
    assert runs["fsdp"].returncode != 0 and "resize_() on an invalid python storage" in runs["fsdp"].stderr
