"""Titan's Qwen3.5 against Hugging Face's `Qwen3_5ForCausalLM` and `Qwen3_5MoeForCausalLM` (transformers 5.23,
its pure-PyTorch path), an implementation nobody here wrote: a checkpoint transformers saved in the Hub
layout imports with equal logits, Titan's export reloads in transformers with every tensor equal, an
image-text folder's text weights import with its vision tower skipped.

Every parameter is random: norms (zero-centred and gated), the attention's output gate, `A_log`,
`dt_bias` and the convolution's taps included (`family_checks.perturb`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from family_checks import materialised, perturb, tokens_for
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3_5Config, Qwen3_5ForConditionalGeneration

from titan_models import load_safetensors_sharded, save_safetensors_sharded
from titan_models.qwen3_5 import (
    Qwen3_5Args,
    Qwen3_5Model,
    Qwen3_5StateDictAdapter,
    args_from_hf_config,
    hf_config_differences,
    qwen3_5_args,
    qwen3_5_moe_args,
)

# Two linear blocks then a full one, twice over; sequences of 80 cross a 64-token chunk of the delta rule.
_BASE = dict(
    dim=64,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=96,
    head_dim=32,
    hidden_dim=96,
    max_seq_len=80,
    full_attention_interval=2,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    rope_theta=10000.0,
)
SHAPES = {
    "dense": Qwen3_5Args(**_BASE),
    "dense-tied": Qwen3_5Args(**{**_BASE, "tie_word_embeddings": True}),
    "moe": Qwen3_5Args(**_BASE, moe_inter_dim=32, shared_hidden_dim=48, moe_args=qwen3_5_moe_args(8, 2)),
}


def slow_decays(model: torch.nn.Module, seed: int) -> None:
    """Decay rates of a long memory (exp(A_log) in [0.01, 1], dt_bias around -1), so that the state carries
    across the delta rule's chunks instead of fading within a few tokens."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.01, 1.0, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.copy_(-1.0 + 0.5 * torch.randn(p.shape, generator=gen))


def random_hf(args: Qwen3_5Args, seed: int):
    """A transformers model of `args`' config, every parameter random (`perturb`, `slow_decays`)."""
    config = AutoConfig.for_model(**Qwen3_5StateDictAdapter(args).hf_config())
    config._attn_implementation = "eager"
    hf = AutoModelForCausalLM.from_config(config).eval()
    perturb(hf, seed=seed)
    slow_decays(hf, seed=seed)
    return hf


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_transformers_checkpoint_imports_with_equal_logits_and_maps_back_identically(shape, tmp_path):
    """Planted: the delta rule's decay applied after the state's update instead of before fails this test."""
    args = SHAPES[shape]
    hf = random_hf(args, seed=len(shape))
    hf.save_pretrained(tmp_path)
    hf_state = load_safetensors_sharded(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert hf_config_differences(args, config) == []
    ours = Qwen3_5Model(args_from_hf_config(config, max_seq_len=args.max_seq_len)).eval()
    adapter = Qwen3_5StateDictAdapter(args)
    ours.load_state_dict(adapter.from_hf(hf_state), strict=True)
    tokens = tokens_for(args)
    with torch.no_grad():
        expected, got = hf(tokens).logits, ours(tokens)
    assert expected.abs().max().item() > 0.5  # not a comparison of near-zero logits
    print(f"relative {_relative(got, expected):.2e}")
    assert _relative(got, expected) <= 1e-5
    back = adapter.to_hf(ours.state_dict())
    assert back.keys() == hf_state.keys()
    assert all(torch.equal(back[k], hf_state[k]) for k in hf_state)


@pytest.mark.parametrize("shape", ["dense-tied", "moe"])
def test_titan_export_reloads_in_transformers_with_every_tensor_equal(shape, tmp_path):
    args = SHAPES[shape]
    ours = materialised(Qwen3_5Model, args, seed=5)
    perturb(ours, seed=6)
    slow_decays(ours, seed=6)
    ours.eval()
    adapter = Qwen3_5StateDictAdapter(args)
    exported = adapter.to_hf(ours.state_dict())
    save_safetensors_sharded(exported, tmp_path, config=adapter.hf_config())
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(hf).__name__ == ("Qwen3_5MoeForCausalLM" if args.moe_args else "Qwen3_5ForCausalLM")
    theirs = hf.state_dict()
    if args.tie_word_embeddings:
        assert theirs["lm_head.weight"].data_ptr() == theirs["model.embed_tokens.weight"].data_ptr()
        theirs.pop("lm_head.weight")
    # transformers fuses the experts it loads; its own export writes them back per expert.
    hf.save_pretrained(tmp_path / "again")
    reloaded = load_safetensors_sharded(tmp_path / "again")
    assert reloaded.keys() == exported.keys()
    assert all(torch.equal(reloaded[k], exported[k]) for k in exported)
    with torch.no_grad():
        assert _relative(ours(tokens_for(args)), hf(tokens_for(args)).logits) <= 1e-5


def test_an_image_text_folder_imports_its_text_weights_and_says_the_tower_is_skipped(tmp_path, caplog):
    args = SHAPES["dense"]
    text = Qwen3_5StateDictAdapter(args).hf_config()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=args.dim)
    full = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).eval()
    perturb(full, seed=3)
    slow_decays(full, seed=3)
    full.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "qwen3_5" and "vision_config" in config
    hf_state = load_safetensors_sharded(tmp_path)
    assert any(k.startswith("model.visual.") for k in hf_state)
    with caplog.at_level(logging.INFO, logger="titan_models.qwen3_5"):
        ours = Qwen3_5Model(args_from_hf_config(config, max_seq_len=args.max_seq_len)).eval()
        ours.load_state_dict(Qwen3_5StateDictAdapter(args).from_hf(hf_state), strict=True)
    assert "vision tower" in caplog.text and "model.visual." in caplog.text
    assert hf_config_differences(args, config) == []
    tokens = tokens_for(args)
    with torch.no_grad():
        expected = full(input_ids=tokens).logits
        assert _relative(ours(tokens), expected) <= 1e-5


PUBLISHED = Path(__file__).parent / "published_configs"
PUBLISHED_FLAVORS = {
    "0.8B": "Qwen3.5-0.8B",
    "4B": "Qwen3.5-4B",
    "9B": "Qwen3.5-9B",
    "27B": "Qwen3.5-27B",
    "35B-A3B": "Qwen3.5-35B-A3B",
    "397B-A17B": "Qwen3.5-397B-A17B",
}


@pytest.mark.parametrize(("flavor", "published"), PUBLISHED_FLAVORS.items())
def test_each_published_flavor_is_the_model_its_config_json_describes(flavor, published):
    """The image-text folder's config.json (tests/published_configs; the sources of each copy are named in
    its README) read by Titan gives the flavor's args, and no field that changes the function differs.
    Planted: the 9B flavor with 48 linear value heads fails it."""
    config = json.loads((PUBLISHED / f"{published}.json").read_text())
    args = qwen3_5_args(flavor)
    assert hf_config_differences(args, config) == []
    assert args_from_hf_config(config, max_seq_len=args.max_seq_len) == args
    text = config["text_config"]
    assert list(args.block_types) == text["layer_types"]
    assert (args.linear_num_key_heads, args.linear_num_value_heads) == (
        text["linear_num_key_heads"],
        text["linear_num_value_heads"],
    )


def test_published_flavors_match_their_configs():
    c = Qwen3_5StateDictAdapter(qwen3_5_args("27B")).hf_config()
    assert (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["head_dim"]) == (
        5120,
        17408,
        64,
        256,
    )
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"]) == (24, 4, 248320)
    assert (c["linear_num_key_heads"], c["linear_num_value_heads"]) == (16, 48)
    assert c["layer_types"][:4] == ["linear_attention"] * 3 + ["full_attention"]
    assert c["rope_parameters"]["partial_rotary_factor"] == 0.25
    m = Qwen3_5StateDictAdapter(qwen3_5_args("35B-A3B")).hf_config()
    assert (m["model_type"], m["num_experts"], m["num_experts_per_tok"], m["moe_intermediate_size"]) == (
        "qwen3_5_moe_text",
        256,
        8,
        512,
    )
    assert m["shared_expert_intermediate_size"] == 512 and m["num_hidden_layers"] == 40
