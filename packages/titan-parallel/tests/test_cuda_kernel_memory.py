"""CUDA's fused rms_norm and attention memory on fake CPU tensors: what they save for backward."""

import contextlib
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from titan_parallel.activation_checkpoint import _per_op_contexts
from titan_parallel.cuda_kernel_memory import cuda_attention_memory, use_cuda_kernel_memory


def _saved_by_norm(emulate: bool) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of the distinct storages one RMSNorm saves for backward, on fake tensors."""
    saved = {}

    def pack(t):
        saved.setdefault(id(t.untyped_storage()), (tuple(t.shape), t.dtype))
        return t

    with torch._subclasses.FakeTensorMode():
        norm = nn.RMSNorm(64)
        if emulate:
            use_cuda_kernel_memory(norm)
        x = torch.randn(4, 32, 64, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = norm(x)
        out.sum().backward()
        assert out.shape == x.shape and x.grad.shape == x.shape and norm.weight.grad.shape == (64,)
    return sorted(saved.values(), key=str)


def test_the_emulated_norm_saves_what_the_cuda_kernel_saves():
    """On an H200 (torch 2.11, bench/RESULTS.md) rms_norm saved its input and a float32 reciprocal RMS per
    row (with the weight); the CPU composite also saves the normalised input, an activation-sized tensor."""
    expected = [((4, 32, 1), torch.float32), ((4, 32, 64), torch.float32), ((64,), torch.float32)]
    assert _saved_by_norm(emulate=True) == sorted(expected, key=str)
    composite = _saved_by_norm(emulate=False)
    assert sum(shape == (4, 32, 64) for shape, _ in composite) > 1  # why the emulation exists


def test_the_emulated_norm_recomputes_under_selective_checkpointing():
    """The recompute in backward runs outside any mode: the swap is on the module, so it repeats the same ops."""
    with torch._subclasses.FakeTensorMode():
        block = nn.Sequential(nn.RMSNorm(64), nn.Linear(64, 64, bias=False), nn.RMSNorm(64))
        use_cuda_kernel_memory(block)
        context = functools.partial(_per_op_contexts, set())
        x = torch.randn(4, 32, 64, requires_grad=True)
        checkpoint(block, x, use_reentrant=False, context_fn=context).sum().backward()
        assert x.grad.shape == x.shape and all(p.grad is not None for p in block.parameters())


def _saved_by_attention(
    emulate: bool, v_dim: int, mask: bool = False
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of the distinct storages one SDPA call saves for backward, on fake tensors."""
    saved = {}

    def pack(t):
        saved.setdefault(id(t.untyped_storage()), (tuple(t.shape), t.dtype))
        return t

    with torch._subclasses.FakeTensorMode(), cuda_attention_memory() if emulate else contextlib.nullcontext():
        q, k = (torch.randn(2, 4, 64, 24, requires_grad=True) for _ in range(2))
        v = torch.randn(2, 4, 64, v_dim, requires_grad=True)
        attn_mask = torch.ones(64, 64, dtype=torch.bool).tril() if mask else None
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=not mask)
        out.sum().backward()
        assert out.shape == (2, 4, 64, v_dim) and q.grad.shape == q.shape and v.grad.shape == v.shape
    return sorted(saved.values(), key=str)


def test_attention_with_another_value_dim_saves_what_the_cuda_kernel_saves():
    """On an H200 a 4-block DeepSeek-V2-Lite (head dims 192/128) held 39.90 GiB; the CPU's math path,
    which saves every head's score matrix, made the estimate 59.87 (bench/RESULTS.md)."""
    q_k = [((2, 4, 64, 24), torch.float32)] * 2
    kernel = sorted(
        [*q_k, ((2, 4, 64, 16), torch.float32), ((2, 4, 64, 16), torch.float32), ((2, 4, 64), torch.float32)],
        key=str,
    )  # q, k, v, the output, the logsumexp
    for mask in (False, True):
        assert _saved_by_attention(emulate=True, v_dim=16, mask=mask) == kernel
        math_path = _saved_by_attention(emulate=False, v_dim=16, mask=mask)
        assert ((2, 4, 64, 64), torch.float32) in math_path  # the score matrix: why the emulation exists
    assert F.scaled_dot_product_attention.__name__ == "scaled_dot_product_attention"  # restored


@pytest.mark.parametrize("mask", [False, True])
def test_attention_with_equal_head_dims_is_left_to_the_cpu_flash_kernel(mask):
    emulated = _saved_by_attention(emulate=True, v_dim=24, mask=mask)
    assert emulated == _saved_by_attention(emulate=False, v_dim=24, mask=mask)
    assert ((2, 4, 64, 64), torch.float32) not in emulated
