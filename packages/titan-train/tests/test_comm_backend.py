"""COMM_BACKEND's decision: which names exist, and where NVSHMEM cannot back a run (refused, not ignored).
The launch scripts' use of it: tests/test_apps.py."""

import pytest

from titan_train.comm_backend import check_comm_backend, comm_backend
from titan_train.config import load_job_config
from titan_train.errors import ConfigError


def test_unset_or_empty_is_nccl_and_an_unknown_name_is_refused():
    assert comm_backend({}) == comm_backend({"COMM_BACKEND": ""}) == "nccl"
    assert comm_backend({"COMM_BACKEND": "nvshmem"}) == "nvshmem"
    with pytest.raises(ConfigError, match=r"^COMM_BACKEND=NCCL is not one of nccl, nvshmem"):
        comm_backend({"COMM_BACKEND": "NCCL"})


def test_nvshmem_is_refused_without_cuda_or_without_a_symmetric_memory_user(monkeypatch):
    from torch.distributed import _symmetric_memory as symm_mem

    env = {"COMM_BACKEND": "nvshmem"}
    config = load_job_config([])
    with pytest.raises(ConfigError, match="NVSHMEM needs CUDA GPUs, and this run's device is cpu"):
        check_comm_backend(config, "cpu", env)
    monkeypatch.setattr(symm_mem, "is_nvshmem_available", lambda: True)
    with pytest.raises(ConfigError, match="nothing in this run uses symmetric memory"):
        check_comm_backend(config, "cuda", env)
    config.parallelism.enable_async_tensor_parallel = True
    assert check_comm_backend(config, "cuda", env) == "nvshmem"
    monkeypatch.setattr(symm_mem, "is_nvshmem_available", lambda: False)
    with pytest.raises(ConfigError, match="finds no NVSHMEM .*pip install nvidia-nvshmem-cu12"):
        check_comm_backend(config, "cuda", env)
    assert check_comm_backend(config, "cpu", {"COMM_BACKEND": "nccl"}) == "nccl"
