"""Mixture-of-experts on one GPU: the grouped-matmul kernel against the per-expert loop, and the
MoE debug models trained end to end by titan-train (bf16 autocast, expert-bias balancing).

On CUDA, `torch._grouped_mm` runs a fused kernel for bf16 on sm90+ and a fallback elsewhere; the CPU
tests (packages/titan-models/tests/test_moe.py) only ever see the fallback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_models.moe import experts_for_loop, experts_grouped_mm

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]


def _experts(num_experts: int, dim: int, hidden: int, tokens: int, dtype: torch.dtype, seed: int):
    """Random weights (E, out, in), expert-sorted rows and uneven counts with one idle expert."""
    g = torch.Generator().manual_seed(seed)
    w1, w3 = (torch.randn(num_experts, hidden, dim, generator=g) / dim**0.5 for _ in range(2))
    w2 = torch.randn(num_experts, dim, hidden, generator=g) / hidden**0.5
    x = torch.randn(tokens, dim, generator=g)
    weights = torch.rand(num_experts, generator=g)
    weights[1] = 0.0  # an expert that gets no token
    counts = (weights / weights.sum() * tokens).long()
    counts[0] += tokens - counts.sum()
    to_cuda = [t.cuda().to(dtype).requires_grad_() for t in (w1, w2, w3, x)]
    return to_cuda, counts.cuda()


def _forward_backward(kernel, tensors, counts, grad_out):
    w1, w2, w3, x = (t.detach().clone().requires_grad_() for t in tensors)
    out = kernel(w1, w2, w3, x, counts)
    out.backward(grad_out)
    return out, [t.grad for t in (w1, w2, w3, x)]


@pytest.mark.parametrize("dtype,bound", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
def test_grouped_mm_equals_the_per_expert_loop_in_outputs_and_gradients(dtype, bound, rel_error, report):
    tensors, counts = _experts(num_experts=8, dim=256, hidden=512, tokens=4096, dtype=dtype, seed=0)
    grad_out = torch.randn(
        4096, 256, device="cuda", dtype=dtype, generator=torch.Generator("cuda").manual_seed(1)
    )
    # The reference: the loop in float64 on the same (rounded) inputs.
    ref_out, ref_grads = _forward_backward(
        experts_for_loop, [t.double() for t in tensors], counts, grad_out.double()
    )
    errors = {}
    for name, kernel in (("grouped", experts_grouped_mm), ("loop", experts_for_loop)):
        out, grads = _forward_backward(kernel, tensors, counts, grad_out)
        errors[name] = [rel_error(out, ref_out)] + [
            rel_error(g, r) for g, r in zip(grads, ref_grads, strict=True)
        ]
    report(dtype=str(dtype), grouped=max(errors["grouped"]), loop=max(errors["loop"]))
    assert max(errors["grouped"]) < bound, errors
    # The fused kernel is no less accurate than the loop of plain matmuls (both accumulate in float32).
    assert max(errors["grouped"]) < 2 * max(errors["loop"]) + 1e-6, errors


def _time_ms(fn, repeats: int = 10) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def test_grouped_mm_is_faster_than_the_loop_at_deepseek_v2_lite_shape(report):
    # One MoE layer of DeepSeek-V2-Lite (deepseek_v3 "16B"): 64 experts of width 1408 over dim 2048,
    # a batch of 8192 tokens routed top-6, bf16, forward and backward.
    tensors, counts = _experts(
        num_experts=64, dim=2048, hidden=1408, tokens=8192 * 6, dtype=torch.bfloat16, seed=2
    )
    grad_out = torch.randn_like(tensors[3])
    ms = {
        name: _time_ms(lambda kernel=kernel: _forward_backward(kernel, tensors, counts, grad_out))
        for name, kernel in (("grouped", experts_grouped_mm), ("loop", experts_for_loop))
    }
    report(grouped_ms=ms["grouped"], loop_ms=ms["loop"], speedup=ms["loop"] / ms["grouped"])
    assert ms["grouped"] < ms["loop"], ms


@pytest.mark.parametrize("config", ["deepseek_v3_debug", "qwen3_moe_debug", "llama4_debug"])
def test_moe_debug_config_trains_on_the_gpu_with_expert_load_logged(config, tmp_path, report):
    command = [
        sys.executable,
        "-m",
        "titan_train.cli",
        "--job.config_file",
        str(REPO / "apps/configs" / f"{config}.toml"),
        "--job.dump_folder",
        str(tmp_path),
        "--training.steps",
        "30",
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard",
        "false",
        "--metrics.disable_color_printing",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records]
    report(
        first_loss=losses[0],
        last_loss=losses[-1],
        tps=records[-1]["tps"],
        memory_gib=records[-1]["memory_gib"],
    )
    assert [r["step"] for r in records] == list(range(1, 31))
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0, losses
    assert all(r["expert_load"] for r in records), records[-1]
