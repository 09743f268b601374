"""The titan engine is the policy for every family it serves: on a tiny model of each registered family (the
variants of test_hf_export_vllm: random weights, norms, biases, sinks and routing biases; MLA at two latent
sizes, Llama 4's chunked attention, Qwen3.5's Gated DeltaNet), its greedy tokens, decoded as a GRPO step
decodes (every prompt in one left-padded batch through the KV cache, `titan_models.generation.generate`),
equal transformers' greedy `generate` on the model's Hugging Face export, one prompt at a time.

Independent of vLLM (its environment is not needed here). Planted once (2026-12-03): the batch's left padding
marked as real tokens in the cache (attended to) failed all 12 variants on the 7-token prompts batched with the
140-token one. (Positions counted from the padding instead of each row's first token did not fail: RoPE's
scores depend on differences of positions, and no chunk boundary fell inside these short rows.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from family_exports import NEW, PROMPTS, REFUSED, SERVED, _export, _transformers_greedy

from titan_models.generation import SamplingParams, generate

pytestmark = pytest.mark.slow

FLOAT32 = {name: v[:4] for name, v in {**SERVED, **REFUSED}.items() if v[3] == "float32"}


@pytest.mark.parametrize("name", FLOAT32)
def test_the_titan_engines_batched_greedy_tokens_equal_transformers_on_the_export(tmp_path, name):
    family, flavor, overrides, dtype = FLOAT32[name]
    model = _export(tmp_path, family, flavor, overrides, dtype).eval()
    with torch.no_grad():
        ours = generate(model, PROMPTS, SamplingParams(max_new_tokens=NEW), pad_id=0).tokens
    assert [list(t) for t in ours] == _transformers_greedy(tmp_path, dtype)
