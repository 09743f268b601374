"""Titan's Qwen3 against Hugging Face's `Qwen3ForCausalLM` and `Qwen3MoeForCausalLM` (transformers 5),
an implementation nobody here wrote: weights both ways, config both ways, refusals in one line."""

import pytest
from family_checks import check_hf_export, check_hf_import, check_refused_in_one_line

from titan_models import (
    WeightMappingError,
)
from titan_models.qwen3 import (
    Qwen3Args,
    Qwen3Model,
    Qwen3StateDictAdapter,
    args_from_hf_config,
    hf_config_differences,
    qwen3_args,
    qwen3_moe_args,
)

_BASE = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, hidden_dim=96, max_seq_len=32)
SHAPES = {
    # 0.6B in miniature: head_dim (32) wider than dim / n_heads (16), tied embeddings.
    "dense-tied": Qwen3Args(**_BASE, head_dim=32, tie_word_embeddings=True),
    "dense": Qwen3Args(**_BASE, head_dim=16, rope_theta=10000.0),
    # 30B-A3B in miniature: 8 experts, top 2, renormalised, no shared expert.
    "moe": Qwen3Args(**_BASE, head_dim=16, moe_inter_dim=32, moe_args=qwen3_moe_args(8, 2)),
    "moe-unnormalised": Qwen3Args(
        **_BASE, head_dim=16, moe_inter_dim=32, moe_args=qwen3_moe_args(8, 2, False)
    ),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_hugging_face_checkpoint_imports_with_equal_logits_and_maps_back_identically(shape, tmp_path):
    args = SHAPES[shape]
    check_hf_import(
        args,
        Qwen3StateDictAdapter(args),
        Qwen3Model,
        tmp_path,
        args_from_hf_config=args_from_hf_config,
        hf_config_differences=hf_config_differences,
        attn_implementation="eager",
        seed=len(shape),
    )


@pytest.mark.parametrize("shape", ["dense-tied", "moe"])
def test_titan_export_loads_in_transformers_with_equal_logits(shape, tmp_path):
    args = SHAPES[shape]
    hf_class = "Qwen3MoeForCausalLM" if args.moe_args else "Qwen3ForCausalLM"
    check_hf_export(
        args,
        Qwen3StateDictAdapter(args),
        Qwen3Model,
        tmp_path,
        attn_implementation="eager",
        hf_class=hf_class,
    )


def test_flavor_configs_match_the_published_qwen3_releases():
    c = Qwen3StateDictAdapter(qwen3_args("0.6B")).hf_config()
    assert (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["head_dim"]) == (
        1024,
        3072,
        28,
        128,
    )
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["tie_word_embeddings"]) == (16, 8, True)
    assert Qwen3StateDictAdapter(qwen3_args("8B")).hf_config()["tie_word_embeddings"] is False
    m = Qwen3StateDictAdapter(qwen3_args("30B-A3B")).hf_config()
    assert (m["model_type"], m["num_experts"], m["num_experts_per_tok"], m["moe_intermediate_size"]) == (
        "qwen3_moe",
        128,
        8,
        768,
    )
    assert m["norm_topk_prob"] is True and m["num_key_value_heads"] == 4


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type"),
        ({"mlp_only_layers": [0]}, "mlp_only_layers"),
        ({"model_type": "qwen2"}, "model_type"),
    ],
)
def test_a_config_titan_cannot_compute_is_refused_in_one_line_naming_the_field(change, field):
    check_refused_in_one_line(
        args_from_hf_config, {**Qwen3StateDictAdapter(SHAPES["moe"]).hf_config(), **change}, field
    )


def test_a_checkpoint_of_another_shape_names_the_differing_fields_and_missing_tensors():
    args = SHAPES["moe"]
    config = {**Qwen3StateDictAdapter(args).hf_config(), "rms_norm_eps": 1e-5, "norm_topk_prob": False}
    assert hf_config_differences(args, config) == [
        "rms_norm_eps: checkpoint 1e-05, flavor 1e-06",
        "norm_topk_prob: checkpoint False, flavor True",
    ]
    state = Qwen3StateDictAdapter(args).to_hf(Qwen3Model(args).state_dict())
    del state["model.layers.1.mlp.experts.7.up_proj.weight"]
    with pytest.raises(
        WeightMappingError, match=r"missing \['model.layers.1.mlp.experts.7.up_proj.weight'\]"
    ):
        Qwen3StateDictAdapter(args).from_hf(state)
