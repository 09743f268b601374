"""gpt-oss's attention (sinks, sliding window), rotary table, experts and sizes, against references
written here or taken from transformers."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask

from titan_models.gpt_oss import (
    GptOssAttention,
    GptOssModel,
    build_gpt_oss_masks,
    gpt_oss_args,
    gpt_oss_moe_args,
    gpt_oss_rotary_table,
    sink_attention_eager,
    sink_attention_flex,
)
from titan_models.moe import count_active_parameters


def _reference(q, k, v, sinks, window, doc_ids=None):
    """exp(score) / (exp(sink) + sum of exp(scores) over the keys each query may see), in float64;
    which keys a query sees is listed position by position."""
    q, k, v, sinks = (t.double() for t in (q, k, v, sinks))
    b, h, s, d = q.shape
    k, v = (t.repeat_interleave(h // k.shape[1], dim=1) for t in (k, v))
    allowed = torch.zeros(b, 1, s, s, dtype=torch.bool)
    for bi in range(b):
        for i in range(s):
            start = 0 if window is None else max(0, i - window + 1)
            for j in range(start, i + 1):
                allowed[bi, 0, i, j] = doc_ids is None or bool(doc_ids[bi, j] == doc_ids[bi, i])
    logits = q @ k.transpose(-1, -2) / math.sqrt(d)
    top = torch.maximum(logits.masked_fill(~allowed, -math.inf).amax(-1), sinks.view(1, h, 1))
    weights = torch.exp(logits - top[..., None]) * allowed
    denominator = weights.sum(-1) + torch.exp(sinks.view(1, h, 1) - top)
    return (weights @ v) / denominator[..., None]


def _args(**kw):
    base = replace(
        gpt_oss_args("debugmodel"),
        dim=64,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        vocab_size=128,
        moe_inter_dim=32,
        max_seq_len=256,
        moe_args=gpt_oss_moe_args(8),
    )
    return replace(base, **kw)


@pytest.mark.parametrize("seq_len", [127, 128, 129, 200])
def test_sinks_and_sliding_window_match_a_direct_softmax_with_gradients(seq_len):
    torch.manual_seed(seq_len)
    args = _args()
    q = torch.randn(1, 4, seq_len, 16, requires_grad=True)
    k = torch.randn(1, 2, seq_len, 16, requires_grad=True)
    v = torch.randn(1, 2, seq_len, 16, requires_grad=True)
    sinks = torch.randn(4, requires_grad=True)
    masks = build_gpt_oss_masks(args, None, seq_len, "cpu")
    grad_out = torch.randn(1, 4, seq_len, 16)
    for mask, window in ((masks.sliding, 128), (masks.full, None)):
        ours = sink_attention_eager(q, k, v, sinks, mask, 1 / math.sqrt(16))
        ref = _reference(q, k, v, sinks, window)
        torch.testing.assert_close(ours.double(), ref, atol=1e-5, rtol=1e-5)
        grads = torch.autograd.grad(ours, (q, k, v, sinks), grad_out)
        ref_grads = torch.autograd.grad(ref, (q, k, v, sinks), grad_out.double())
        for g, r in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g.double(), r.double(), atol=1e-5, rtol=1e-5)
        with torch.no_grad():  # flex attention runs forward-only on CPU: its sink rescaling, checked here
            flex_masks = build_gpt_oss_masks(replace(args, attn_backend="flex"), None, seq_len, "cpu")
            flex_mask = flex_masks.sliding if window else flex_masks.full
            flex = sink_attention_flex(
                q.detach(), k.detach(), v.detach(), sinks, flex_mask, 1 / math.sqrt(16)
            )
        torch.testing.assert_close(flex.double(), ref, atol=1e-5, rtol=1e-5)


class _RankZeroOfTwo:
    """What context parallelism hands rank 0 of 2 over `seq_len` load-balanced positions: chunks 0 and 3 of 4
    here, the gathered keys in rank order (rank 1 holds chunks 1 and 2)."""

    def __init__(self, seq_len: int):
        c = seq_len // 4
        self.positions = torch.cat([torch.arange(c), torch.arange(3 * c, seq_len)])
        self.everywhere = torch.cat([self.positions, torch.arange(c, 3 * c)])

    def all_positions(self) -> torch.Tensor:
        return self.everywhere

    def gather(self, tensor, dim):  # the masks only store it; the test gathers by hand
        raise AssertionError("not called when building masks")


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_a_context_parallel_shard_attends_by_global_positions(backend):
    """Rank 0's queries (positions 0-49 and 150-199 of 200) against every rank's keys in gathered order,
    masked by global positions: the reference's rows at those positions (flex forward only on CPU)."""
    torch.manual_seed(3)
    shard = _RankZeroOfTwo(200)
    q, k, v = torch.randn(1, 4, 200, 16), torch.randn(1, 2, 200, 16), torch.randn(1, 2, 200, 16)
    sinks = torch.randn(4)
    with torch.no_grad():  # flex masks are built on CPU only where no backward follows
        masks = build_gpt_oss_masks(_args(attn_backend=backend), None, 100, "cpu", shard)
    assert isinstance(masks.full, BlockMask) == (backend == "flex")
    assert masks.gather_kv == shard.gather
    local_q, gathered_k, gathered_v = (
        q[:, :, shard.positions],
        k[:, :, shard.everywhere],
        v[:, :, shard.everywhere],
    )
    attend = sink_attention_flex if backend == "flex" else sink_attention_eager
    for mask, window in ((masks.sliding, 128), (masks.full, None)):
        ours = attend(local_q, gathered_k, gathered_v, sinks, mask, 0.25)
        want = _reference(q, k, v, sinks, window)[:, :, shard.positions]
        torch.testing.assert_close(ours.double(), want, atol=1e-5, rtol=1e-5)


def test_block_causal_sliding_window_keeps_documents_apart():
    torch.manual_seed(1)
    args = _args(attn_mask_type="block_causal", eos_id=0)
    doc_ids = torch.tensor([[0] * 60 + [1] * 70 + [2] * 70, [0] * 150 + [1] * 50])
    q, k, v = torch.randn(2, 4, 200, 16), torch.randn(2, 2, 200, 16), torch.randn(2, 2, 200, 16)
    sinks = torch.randn(4)
    masks = build_gpt_oss_masks(args, doc_ids, 200, "cpu")
    for mask, window in ((masks.sliding, 128), (masks.full, None)):
        ours = sink_attention_eager(q, k, v, sinks, mask, 0.25)
        torch.testing.assert_close(
            ours.double(), _reference(q, k, v, sinks, window, doc_ids), atol=1e-5, rtol=1e-5
        )


def test_even_layers_see_128_positions_and_odd_layers_the_whole_context():
    torch.manual_seed(2)
    args = _args()
    x = torch.randn(1, 200, 64)
    masks = build_gpt_oss_masks(args, None, 200, "cpu")
    freqs = gpt_oss_rotary_table(args)
    for layer, sees_71 in ((0, False), (1, True), (2, False), (3, True)):
        attention = GptOssAttention(args, layer)
        torch.nn.init.normal_(attention.sinks)
        base = attention(x, freqs, masks)[0, 199]
        # Query 199 of a windowed layer sees positions 72..199: 128 keys, itself included.
        for pos, seen in ((71, sees_71), (72, True)):
            moved = x.clone()
            moved[0, pos] += 1.0
            changed = not torch.allclose(attention(moved, freqs, masks)[0, 199], base)
            assert changed == seen, (layer, pos)


def test_yarn_rotary_table_equals_transformers():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    args = replace(gpt_oss_args("20b"), max_seq_len=8192)
    config = GptOssConfig(head_dim=64, max_position_embeddings=131072)
    positions = torch.tensor([[0, 1, 127, 4095, 4096, 8191]])
    cos, sin = GptOssRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions)
    table = torch.view_as_real(gpt_oss_rotary_table(args)[positions[0]])
    # transformers repeats each frequency over both halves of the head.
    torch.testing.assert_close(table[..., 0], cos[0, :, :32], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(table[..., 1], sin[0, :, :32], atol=1e-5, rtol=1e-5)


def test_parameter_counts_equal_openais_published_figures():
    # gpt-oss model card (OpenAI, 2025), table 1: total and active parameters (active counts the
    # unembedding and 4 experts per layer, not the embedding).
    published = {"20b": (20.91e9, 3.61e9), "120b": (116.83e9, 5.13e9)}
    for flavor, (total, active) in published.items():
        with torch.device("meta"):
            model = GptOssModel(gpt_oss_args(flavor))
        assert sum(p.numel() for p in model.parameters()) == pytest.approx(total, abs=0.005e9)
        assert count_active_parameters(model, exclude_embedding=True) == pytest.approx(active, abs=0.005e9)
