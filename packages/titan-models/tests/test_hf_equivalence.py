"""Our Llama against Hugging Face's `LlamaForCausalLM`, an implementation nobody here wrote."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from titan_models import (
    LlamaStateDictAdapter,
    ModelArgs,
    RopeScaling,
    Transformer,
    WeightMappingError,
    llama3_args,
    load_safetensors_sharded,
    save_safetensors_sharded,
)

SHAPES = {
    # Llama 2 70B in miniature: grouped-query attention, theta 10000, no rotary scaling.
    "llama2": ModelArgs(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=96,
        multiple_of=32,
        ffn_dim_multiplier=1.3,
        rope_theta=10000,
        max_seq_len=48,
    ),
    # Llama 3.1: GQA and the rotary stretch, with a short original context so that the kept, the
    # divided and the blended frequency bands all occur within 48 positions.
    "llama3.1": ModelArgs(
        dim=64,
        n_layers=2,
        n_heads=8,
        n_kv_heads=2,
        vocab_size=96,
        multiple_of=32,
        rope_theta=500000,
        max_seq_len=48,
        rope_scaling=RopeScaling(
            factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=32
        ),
    ),
    # Llama 3.2 1B/3B: tied embedding and output matrix.
    "llama3.2-tied": ModelArgs(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=1,
        vocab_size=96,
        multiple_of=32,
        rope_theta=500000,
        max_seq_len=48,
        tie_word_embeddings=True,
        rope_scaling=RopeScaling(factor=32.0, original_max_seq_len=32),
    ),
}


def _random_hf_model(args: ModelArgs, seed: int) -> LlamaForCausalLM:
    config = LlamaConfig(**LlamaStateDictAdapter(args).hf_config(), attn_implementation="eager")
    model = LlamaForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Norm weights away from 1 so that a swapped norm would show.
            base = 1.0 if "norm" in name else 0.0
            p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
    return model


def _ours(args: ModelArgs, state_dict: dict) -> Transformer:
    model = Transformer(args).eval()
    model.load_state_dict(state_dict, strict=True)
    return model


@pytest.mark.parametrize("shape", list(SHAPES))
def test_logits_equal_hugging_face_and_mapping_back_is_identical(shape):
    args = SHAPES[shape]
    adapter = LlamaStateDictAdapter(args)
    hf = _random_hf_model(args, seed=len(shape))
    hf_state = hf.state_dict()
    ours = _ours(args, adapter.from_hf(hf_state))
    tokens = torch.randint(
        0, args.vocab_size, (2, args.max_seq_len), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens)
    assert (got - expected).abs().max().item() <= 1e-5
    assert expected.abs().max().item() > 0.5  # the comparison is not between near-zero logits

    back = adapter.to_hf(ours.state_dict())
    if args.tie_word_embeddings:
        # Hugging Face files store a tied matrix once, under the embedding's name.
        assert hf_state["lm_head.weight"].data_ptr() == hf_state["model.embed_tokens.weight"].data_ptr()
        hf_state = {k: v for k, v in hf_state.items() if k != "lm_head.weight"}
        assert ours.output.weight is ours.tok_embeddings.weight
    assert back.keys() == hf_state.keys()
    for name, tensor in hf_state.items():
        assert torch.equal(back[name], tensor), name


def test_sharded_safetensors_folder_loads_in_transformers_and_back(tmp_path):
    args = SHAPES["llama3.1"]
    adapter = LlamaStateDictAdapter(args)
    with torch.device("meta"):
        ours = Transformer(args)
    ours.to_empty(device="cpu")
    ours.init_weights(seed=3)
    ours.eval()
    hf_state = adapter.to_hf(ours.state_dict())
    paths = save_safetensors_sharded(hf_state, tmp_path, max_shard_bytes=40_000, config=adapter.hf_config())

    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(paths) > 2 and sorted(set(index["weight_map"].values())) == sorted(p.name for p in paths)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in hf_state.values())

    loaded = load_safetensors_sharded(tmp_path)
    assert loaded.keys() == hf_state.keys()
    assert all(torch.equal(loaded[k], hf_state[k]) for k in hf_state)

    hf = LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    tokens = torch.randint(0, args.vocab_size, (1, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (hf(tokens).logits - ours(tokens)).abs().max().item() <= 1e-5
    reloaded = _ours(args, adapter.from_hf(loaded))
    for name, tensor in ours.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


def test_published_flavor_configs_match_the_llama_3_1_release():
    config = LlamaStateDictAdapter(llama3_args("8B")).hf_config()
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (
        4096,
        14336,
        32,
    )
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]) == (
        32,
        8,
        128256,
    )
    assert config["rope_theta"] == 500000.0
    assert config["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert LlamaConfig(**config).num_key_value_heads == 8


def test_mapping_a_checkpoint_of_another_shape_names_what_is_missing():
    args = SHAPES["llama2"]
    hf_state = _random_hf_model(args, seed=0).state_dict()
    deeper = LlamaStateDictAdapter(ModelArgs(**{**args.__dict__, "n_layers": 3}))
    with pytest.raises(WeightMappingError, match=r"missing \['model.layers.2"):
        deeper.from_hf(hf_state)


def test_loading_a_folder_without_safetensors_says_what_is_expected(tmp_path):
    with pytest.raises(WeightMappingError, match="model.safetensors.index.json"):
        load_safetensors_sharded(tmp_path)


def test_names_inside_compiled_blocks_map_like_plain_ones():
    args = SHAPES["llama2"]
    model = Transformer(args)
    expected = LlamaStateDictAdapter(args).to_hf(model.state_dict())
    model.layers["0"] = torch.compile(model.layers["0"])  # wraps only; nothing compiles until called
    assert any("_orig_mod" in name for name in model.state_dict())
    mapped = LlamaStateDictAdapter(args).to_hf(model.state_dict())
    assert mapped.keys() == expected.keys() and all(torch.equal(mapped[k], expected[k]) for k in expected)
