"""KV-cache generation of every mixture-of-experts family against transformers' `generate`.

Each family in miniature is built by transformers (random weights and buffers, fp32), saved, imported
through Titan's Hugging Face import, and both continue two prompts of different lengths greedily. Titan
runs them as one left-padded batch through its KV cache; transformers runs each prompt alone (the
exact meaning of a padded row). The tokens must agree one for one, and the logits of every step
to 1e-4. What each shape exercises:
- Qwen3-MoE: QK norm, half-split rotary, 8 experts top 2;
- Llama 4: a no-rope layer with temperature tuning (scales change every 4 positions), chunks of 8
  on rope layers with QK norm, Llama 3.1 rotary scaling, sigmoid routing and a shared expert;
- DeepSeek-V3: MLA (low-rank queries, the latent cache), YaRN with its mscale, group-limited routing
  with the score-correction bias;
- gpt-oss: sinks, a window of 8 on even layers, YaRN, biased experts with router bias.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from test_deepseek_v3_hf import _hf_config as deepseek_hf_config
from test_gpt_oss import _args as gpt_oss_shape
from test_llama4_hf import SHAPES as LLAMA4_SHAPES
from test_qwen3_hf import SHAPES as QWEN3_SHAPES

from titan_models import KVCache, SamplingParams, forward_cached, generate, load_safetensors_sharded
from titan_models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3StateDictAdapter
from titan_models.deepseek_v3 import args_from_hf_config as deepseek_args
from titan_models.gpt_oss import GptOssModel, GptOssStateDictAdapter
from titan_models.gpt_oss import args_from_hf_config as gpt_oss_args
from titan_models.gpt_oss import to_hf_config as gpt_oss_hf_config
from titan_models.llama4 import Llama4Model, Llama4StateDictAdapter
from titan_models.llama4 import args_from_hf_config as llama4_args
from titan_models.qwen3 import Qwen3Model, Qwen3StateDictAdapter
from titan_models.qwen3 import args_from_hf_config as qwen3_args

MAX_LEN = 64
NEW = 24


def _qwen3_moe() -> transformers.PretrainedConfig:
    args = QWEN3_SHAPES["moe"]
    return transformers.AutoConfig.for_model(**Qwen3StateDictAdapter(args).hf_config())


def _llama4() -> transformers.PretrainedConfig:
    args = LLAMA4_SHAPES["17bx16e_irope"]
    return transformers.AutoConfig.for_model(**Llama4StateDictAdapter(args).hf_config())


def _deepseek_v3() -> transformers.PretrainedConfig:
    return deepseek_hf_config(24, yarn=True)


def _gpt_oss() -> transformers.PretrainedConfig:
    # YaRN by 8 over 256 original positions (see titan-train's test_gpt_oss_hf), a window of 8.
    args = gpt_oss_shape(
        n_layers=2, vocab_size=96, sliding_window_size=8, original_seq_len=256, rope_factor=8.0
    )
    return transformers.GptOssConfig(**gpt_oss_hf_config(args))


FAMILIES = {
    "qwen3_moe": (_qwen3_moe, qwen3_args, Qwen3Model, Qwen3StateDictAdapter, "eager"),
    "llama4": (_llama4, llama4_args, Llama4Model, Llama4StateDictAdapter, "sdpa"),
    "deepseek_v3": (_deepseek_v3, deepseek_args, DeepSeekV3Model, DeepSeekV3StateDictAdapter, "eager"),
    "gpt_oss": (_gpt_oss, gpt_oss_args, GptOssModel, GptOssStateDictAdapter, "eager"),
}


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Every floating parameter and buffer but the rotary frequencies: embeddings of std 1, norms around 1,
    query and key projections std 0.1 (scores soft enough that a query scale shows), other weights std
    0.3 (biases and sinks smaller or larger), for varied continuations with clear margins."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if not t.is_floating_point() or "inv_freq" in name:
                continue
            std = 0.3
            for part, part_std in (
                ("embed", 1.0),
                ("sinks", 0.5),
                ("bias", 0.1),
                ("q_proj", 0.1),
                ("k_proj", 0.1),
            ):
                if part in name:
                    std = part_std
                    break
            t.copy_(torch.randn(t.shape, generator=gen) * (0.1 if "norm" in name else std) + ("norm" in name))


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_batched_cached_greedy_tokens_equal_transformers_generate(family, tmp_path):
    make_config, args_from_hf_config, model_cls, adapter_cls, attn = FAMILIES[family]
    config = make_config()
    config.bos_token_id = config.eos_token_id = None  # every token generated on both sides
    config._attn_implementation = attn
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    _randomise(hf, seed=1)
    hf.save_pretrained(tmp_path)

    args = args_from_hf_config(json.loads((tmp_path / "config.json").read_text()), max_seq_len=MAX_LEN)
    ours = model_cls(args).eval()
    ours.load_state_dict(adapter_cls(args).from_hf(load_safetensors_sharded(tmp_path)), strict=True)

    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (13, 5)]
    expected, expected_logits = [], []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW,
                do_sample=False,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
        expected.append(out.sequences[0, len(prompt) :].tolist())
        expected_logits.append(torch.cat(out.logits))
    assert all(len(set(tokens)) >= 6 for tokens in expected)  # varied text, not one repeated token

    got = generate(ours, prompts, SamplingParams(max_new_tokens=NEW), pad_id=0)
    assert got.tokens == expected
    # Tokens can agree while a small error (a query scale at a wrong position) moves logits below the
    # margins: the cached logits of every step must equal transformers' too.
    logits = _cached_logits(ours, prompts, expected)
    for row, want in enumerate(expected_logits):
        assert (logits[row] - want).abs().max().item() <= 1e-4, (family, row)


def _cached_logits(model: torch.nn.Module, prompts: list[list[int]], continuations: list[list[int]]):
    """(batch, NEW, vocab): Titan's logits at each new position, the prompts as one left-padded batch
    through the KV cache, then the given continuations one token a step."""
    width = max(map(len, prompts))
    tokens = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    valid = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in prompts])
    cache = KVCache.for_model(model, len(prompts), width + NEW)
    steps = [forward_cached(model, tokens, cache, valid)]
    for i in range(NEW - 1):
        steps.append(forward_cached(model, torch.tensor([[c[i]] for c in continuations]), cache))
    return torch.stack(steps, dim=1)
