"""Qwen3.5 generation through Titan's cache: the full-attention layers' keys and values per slot, the
linear layers' convolution window and delta-rule state beside them (`RecurrentStateCache`), against
transformers' own greedy generation, and the delta rule's two forms against each other."""

from __future__ import annotations

import pytest
import torch
from test_qwen3_5_hf import SHAPES, random_hf

from titan_models import load_safetensors_sharded
from titan_models.generation import SamplingParams, generate
from titan_models.kv_cache import KVCache, forward_cached
from titan_models.qwen3_5 import Qwen3_5Model, Qwen3_5StateDictAdapter
from titan_models.qwen3_5.gated_delta import chunked_gated_delta, recurrent_gated_delta

PROMPTS = [
    [5, 17, 33, 4, 61, 2, 9],
    [7, 8],
    [90, 1, 1, 1, 40, 12, 3, 3, 77, 50, 21],
    [44],
    [3, 14, 15, 92, 65],
]


def _models(shape: str, folder):
    """A random transformers model and Titan's import of the checkpoint it saved in `folder`."""
    args = SHAPES[shape]
    hf = random_hf(args, seed=11)
    hf.save_pretrained(folder)
    ours = Qwen3_5Model(args).eval()
    ours.load_state_dict(Qwen3_5StateDictAdapter(args).from_hf(load_safetensors_sharded(folder)), strict=True)
    return hf, ours


@pytest.mark.parametrize("shape", ["dense", "moe"])
def test_greedy_generation_through_the_cache_equals_transformers_on_every_prompt(shape, tmp_path):
    """Titan runs the five prompts as one left-padded batch, transformers one at a time with its own cache.

    Planted: the recurrent form's decay applied after the state's update (generation's one-token steps)
    fails this test."""
    hf, ours = _models(shape, tmp_path)
    new = 12
    got = generate(ours, PROMPTS, SamplingParams(max_new_tokens=new)).tokens
    expected = []
    with torch.no_grad():
        for prompt in PROMPTS:
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None)
            expected.append(out[0, len(prompt) :].tolist())
    assert [g == e for g, e in zip(got, expected, strict=True)] == [True] * len(PROMPTS)


def test_cached_logits_equal_the_full_forward_at_every_step(tmp_path):
    _, ours = _models("dense", tmp_path)
    tokens = torch.randint(0, 96, (2, 76), generator=torch.Generator().manual_seed(1))
    cache = KVCache.for_model(ours, batch=2, max_len=80)
    prefill = forward_cached(ours, tokens[:, :70], cache)  # more than a chunk of the delta rule
    steps = [forward_cached(ours, tokens[:, i : i + 1], cache) for i in range(70, 76)]
    with torch.no_grad():
        full = ours(tokens)
    torch.testing.assert_close(prefill, full[:, 69], atol=1e-5, rtol=1e-5)
    for i, logits in enumerate(steps):
        torch.testing.assert_close(logits, full[:, 70 + i], atol=1e-5, rtol=1e-5)


def test_the_chunked_delta_rule_equals_the_recurrent_one_with_resets_and_a_starting_state():
    gen = torch.Generator().manual_seed(0)
    b, s, h, dk, dv = 2, 150, 3, 16, 8
    q, k = (torch.nn.functional.normalize(torch.randn(b, s, h, dk, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(b, s, h, dv, generator=gen)
    g = -0.3 * torch.rand(b, s, h, generator=gen)
    beta = torch.rand(b, s, h, generator=gen)
    resets = torch.rand(b, s, generator=gen) < 0.05
    state = torch.randn(b, h, dk, dv, generator=gen)
    for chunk in (16, 64):
        out, final = chunked_gated_delta(q, k, v, g, beta, resets, state, chunk=chunk)
        ref_out, ref_final = recurrent_gated_delta(q, k, v, g, beta, resets, state)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(final, ref_final, atol=1e-5, rtol=1e-5)
