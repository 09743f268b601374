"""Titan's Llama 4 against Hugging Face's `Llama4ForCausalLM` (text, `Llama4TextConfig`, transformers 5),
an implementation nobody here wrote: weights both ways (fused experts), config both ways, refusals."""

import pytest
from family_checks import check_hf_export, check_hf_import, check_refused_in_one_line

from titan_models import (
    RopeScaling,
    WeightMappingError,
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
    "17bx16e_irope": Llama4Args(
        **_BASE,
        interleave_moe_layer_step=1,
        every_n_layers_nope=2,
        attn_chunk_size=8,
        use_qk_norm=True,
        attn_temperature_tuning=True,
        floor_scale=4,
        attn_scale=0.5,
    ),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_hugging_face_checkpoint_imports_with_equal_logits_and_maps_back_identically(shape, tmp_path):
    args = SHAPES[shape]
    hf_state = check_hf_import(
        args,
        Llama4StateDictAdapter(args),
        Llama4Model,
        tmp_path,
        args_from_hf_config=args_from_hf_config,
        hf_config_differences=hf_config_differences,
        attn_implementation="sdpa",
        seed=len(shape),
    )
    # Hugging Face fuses the experts' gate and up projections into one tensor per layer.
    assert hf_state["model.layers.3.feed_forward.experts.gate_up_proj"].shape == (
        4,
        64,
        2 * args.moe_hidden_dim,
    )


def test_titan_export_loads_in_transformers_with_equal_logits(tmp_path):
    args = SHAPES["17bx16e_irope"]
    check_hf_export(
        args,
        Llama4StateDictAdapter(args),
        Llama4Model,
        tmp_path,
        attn_implementation="sdpa",
        hf_class="Llama4ForCausalLM",
    )


def test_flavor_configs_match_the_published_scout_and_maverick():
    scout = Llama4StateDictAdapter(llama4_args("17bx16e_published")).hf_config()
    widths = ("intermediate_size", "intermediate_size_mlp", "num_local_experts")
    assert [scout[k] for k in widths] == [8192, 16384, 16]
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
    check_refused_in_one_line(
        args_from_hf_config, {**Llama4StateDictAdapter(SHAPES["17bx16e_irope"]).hf_config(), **change}, field
    )


def test_a_checkpoint_of_another_shape_names_the_differing_fields_and_missing_tensors():
    args = SHAPES["17bx16e_irope"]
    config = {**Llama4StateDictAdapter(args).hf_config(), "use_qk_norm": False, "attention_chunk_size": 16}
    assert hf_config_differences(args, config) == [
        "use_qk_norm: checkpoint False, flavor True",
        "attention_chunk_size: checkpoint 16, flavor 8",
    ]
    state = Llama4StateDictAdapter(args).to_hf(Llama4Model(args).state_dict())
    del state["model.layers.2.feed_forward.router.weight"]
    with pytest.raises(WeightMappingError, match=r"missing \['model.layers.2.feed_forward.router.weight'\]"):
        Llama4StateDictAdapter(args).from_hf(state)
