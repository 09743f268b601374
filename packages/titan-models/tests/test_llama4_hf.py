"""Titan's Llama 4 against Hugging Face's `Llama4ForCausalLM` (text, `Llama4TextConfig`, transformers 5),
an implementation nobody here wrote: weights both ways (fused experts), config both ways, refusals."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from titan_models import (
    ModelConfigError,
    RopeScaling,
    WeightMappingError,
    load_safetensors_sharded,
    save_safetensors_sharded,
)
from titan_models.llama4 import (
    Llama4Args,
    Llama4Model,
    Llama4StateDictAdapter,
    args_from_hf_config,
    hf_config_differences,
    llama4_args,
    llama4_moe_args,
)

_BASE = dict(
    dim=64,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=96,
    multiple_of=16,
    max_seq_len=24,
    rope_theta=500000.0,
    moe_args=llama4_moe_args(4),
    rope_scaling=RopeScaling(factor=16.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=16),
)
SHAPES = {
    # Maverick in miniature: dense and MoE blocks alternate, rope everywhere, no chunking.
    "17bx128e": Llama4Args(**_BASE, interleave_moe_layer_step=2),
    # Scout with iRoPE in miniature: every block MoE, a no-rope layer every 2nd layer with temperature
    # tuning (floor 4, so scales change within 24 positions), chunks of 8 on rope layers, QK norm.
    "17bx16e_irope": Llama4Args(**_BASE, interleave_moe_layer_step=1, every_n_layers_nope=2, attn_chunk_size=8,
                                use_qk_norm=True, attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5),
}  # fmt: skip


def _hf_model(config: dict):
    hf_config = AutoConfig.for_model(**config)
    hf_config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(hf_config).eval()


def _perturb(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn(p.shape, generator=gen))


def _tokens(args) -> torch.Tensor:
    return torch.randint(
        0, args.vocab_size, (2, args.max_seq_len), generator=torch.Generator().manual_seed(0)
    )


@pytest.mark.parametrize("shape", list(SHAPES))
def test_hugging_face_checkpoint_imports_with_equal_logits_and_maps_back_identically(shape, tmp_path):
    args = SHAPES[shape]
    adapter = Llama4StateDictAdapter(args)
    hf = _hf_model(adapter.hf_config())
    _perturb(hf, seed=len(shape))
    hf.save_pretrained(tmp_path)
    hf_state = load_safetensors_sharded(tmp_path)
    assert hf_state["model.layers.3.feed_forward.experts.gate_up_proj"].shape == (
        4,
        64,
        2 * args.moe_hidden_dim,
    )

    config = json.loads((tmp_path / "config.json").read_text())
    assert hf_config_differences(args, config) == []
    ours = Llama4Model(args_from_hf_config(config, max_seq_len=args.max_seq_len)).eval()
    ours.load_state_dict(adapter.from_hf(hf_state), strict=True)
    with torch.no_grad():
        expected, got = hf(_tokens(args)).logits, ours(_tokens(args))
    assert (got - expected).abs().max().item() <= 1e-5
    assert expected.abs().max().item() > 0.5

    back = adapter.to_hf(ours.state_dict())
    assert back.keys() == hf_state.keys()
    assert all(torch.equal(back[k], hf_state[k]) for k in hf_state)


def test_titan_export_loads_in_transformers_with_equal_logits(tmp_path):
    args = SHAPES["17bx16e_irope"]
    adapter = Llama4StateDictAdapter(args)
    with torch.device("meta"):
        ours = Llama4Model(args)
    ours.to_empty(device="cpu")
    ours.init_weights(seed=5)
    _perturb(ours, seed=6)
    ours.eval()
    save_safetensors_sharded(adapter.to_hf(ours.state_dict()), tmp_path, config=adapter.hf_config())
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    assert type(hf).__name__ == "Llama4ForCausalLM"
    with torch.no_grad():
        assert (hf(_tokens(args)).logits - ours(_tokens(args))).abs().max().item() <= 1e-5


def test_flavor_configs_match_the_published_scout_and_maverick():
    scout = Llama4StateDictAdapter(llama4_args("17bx16e_irope")).hf_config()
    assert (scout["intermediate_size"], scout["intermediate_size_mlp"], scout["num_local_experts"]) == (
        8192,
        16384,
        16,
    )
    assert scout["moe_layers"] == list(range(48)) and scout["no_rope_layers"][:4] == [1, 1, 1, 0]
    assert scout["rope_scaling"]["factor"] == 16.0 and scout["use_qk_norm"] is True
    assert scout["attention_chunk_size"] == 8192 and scout["vocab_size"] == 202048
    maverick = Llama4StateDictAdapter(llama4_args("17bx128e")).hf_config()
    assert maverick["moe_layers"] == list(range(1, 48, 2)) and maverick["num_local_experts"] == 128
    assert maverick["rope_scaling"] is None


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"no_rope_layers": [1, 0, 0, 1]}, "no_rope_layers"),
        ({"moe_layers": [0]}, "moe_layers"),
        ({"model_type": "llama4"}, "model_type"),
        ({"attention_bias": True}, "attention_bias"),
        ({"head_dim": 32}, "head_dim"),
    ],
)
def test_a_config_titan_cannot_compute_is_refused_in_one_line_naming_the_field(change, field):
    config = {**Llama4StateDictAdapter(SHAPES["17bx16e_irope"]).hf_config(), **change}
    with pytest.raises(ModelConfigError, match=field) as caught:
        args_from_hf_config(config)
    assert "\n" not in str(caught.value)


def test_a_checkpoint_of_another_shape_names_the_differing_fields_and_missing_tensors():
    args = SHAPES["17bx16e_irope"]
    config = {**Llama4StateDictAdapter(args).hf_config(), "use_qk_norm": False, "attention_chunk_size": 16}
    assert hf_config_differences(args, config) == [
        "use_qk_norm: checkpoint False, flavor True", "attention_chunk_size: checkpoint 16, flavor 8",
    ]  # fmt: skip
    state = Llama4StateDictAdapter(args).to_hf(Llama4Model(args).state_dict())
    del state["model.layers.2.feed_forward.router.weight"]
    with pytest.raises(WeightMappingError, match=r"missing \['model.layers.2.feed_forward.router.weight'\]"):
        Llama4StateDictAdapter(args).from_hf(state)
