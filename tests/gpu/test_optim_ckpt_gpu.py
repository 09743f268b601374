"""The optimizer and checkpoint paths that only CUDA takes: fused AdamW, async saves staged into pinned memory."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.gpu

OPTIMIZER_STEPS = 5
FUSED_TOLERANCE = 1e-6  # relative, float32


def _model_and_optimizer(implementation: str):
    from titan_train.config import load_job_config
    from titan_train.wiring.optimizers import build_optimizer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).cuda()
    config = load_job_config(["--optimizer.implementation", implementation])
    return model, build_optimizer(config, model)


def test_fused_adamw_is_fused_on_cuda_and_matches_foreach(report, rel_error):
    fused_model, fused = _model_and_optimizer("fused")
    foreach_model, foreach = _model_and_optimizer("foreach")
    assert isinstance(fused, torch.optim.AdamW)
    assert fused.param_groups[0]["fused"] is True and not fused.param_groups[0]["foreach"]
    assert foreach.param_groups[0]["foreach"] is True and not foreach.param_groups[0]["fused"]
    initial = [p.detach().clone() for p in fused_model.parameters()]

    g = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(OPTIMIZER_STEPS):
        for a, b in zip(fused_model.parameters(), foreach_model.parameters(), strict=True):
            a.grad = torch.randn(a.shape, generator=g, device="cuda")
            b.grad = a.grad.clone()
        fused.step()
        foreach.step()

    params = list(zip(fused_model.parameters(), foreach_model.parameters(), strict=True))
    errors = [rel_error(a, b) for a, b in params]
    moved = min(rel_error(a, start) for (a, _), start in zip(params, initial, strict=True))
    report(max_rel_error=max(errors), smallest_relative_update=moved)
    assert moved > 1e-4, "the optimizers hardly moved the parameters: the comparison would be empty"
    assert max(errors) < FUSED_TOLERANCE


# 16 float32 matrices of 4096 x 4096: 1 GiB on the GPU.
N_MATRICES, SIDE = 16, 4096


def test_async_pinned_memory_save_blocks_less_than_a_sync_save_and_reloads_bit_exact(
    tmp_path, one_rank_nccl_group, report
):
    from titan_ckpt import Checkpointer, LoadPolicy, ModelState, SavePolicy

    with torch.device("cuda"):
        model = nn.ModuleList(nn.Linear(SIDE, SIDE, bias=False) for _ in range(N_MATRICES))
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, device="cuda"))
    states = {"model": ModelState([model])}
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    sync = Checkpointer(tmp_path / "sync", states, saving=SavePolicy(interval=1, async_mode="disabled"))
    started = time.perf_counter()
    sync.save(1)
    sync_s = time.perf_counter() - started
    sync.close()

    pinned = Checkpointer(
        tmp_path / "async", states, saving=SavePolicy(interval=1, async_mode="async_with_pinned_mem")
    )
    started = time.perf_counter()
    pinned.save(1)
    blocked_s = time.perf_counter() - started
    pinned.wait_for_staging()  # what the next optimizer step does before changing the weights
    staged_s = time.perf_counter() - started
    with torch.no_grad():  # training goes on while the files are written
        for p in model.parameters():
            p.add_(1.0)
    pinned.close()
    timing = pinned.timings[-1]
    report(
        state_gib=sum(v.numel() * v.element_size() for v in saved.values()) / 2**30,
        sync_save_s=sync_s,
        async_save_call_s=blocked_s,
        async_staged_after_s=staged_s,
        async_total_s=timing.total_s,
    )
    assert [t.step for t in pinned.timings] == [1]
    assert blocked_s < sync_s, (
        f"the async save call blocked {blocked_s:.3f} s, a sync save takes {sync_s:.3f} s"
    )

    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    loader = Checkpointer(tmp_path / "async", states, loading=LoadPolicy(load_step=1))
    loader.load()
    loader.close()
    reloaded = model.state_dict()
    assert all(torch.equal(reloaded[k], saved[k]) for k in saved), "the reload differs from the saved state"
