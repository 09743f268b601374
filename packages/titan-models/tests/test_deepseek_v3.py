"""The DeepSeek-V3 family: published parameter counts, FLOPs from active parameters, initialisation,
the parallelism protocol (pipeline stages; tensor parallelism on 2 gloo ranks is in test_tensor_parallel.py),
YaRN and argument checks."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from titan_models import ModelConfigError, count_parameters
from titan_models.deepseek_v3 import (
    DEEPSEEK_V3_FLAVORS,
    DeepSeekV3Args,
    DeepSeekV3Model,
    deepseek_flops_per_token,
    deepseek_v3_args,
)
from titan_models.moe import MoEArgs, count_active_parameters, expert_load, update_expert_bias

TINY = DeepSeekV3Args(
    dim=64,
    n_layers=3,
    n_dense_layers=1,
    n_heads=4,
    vocab_size=128,
    inter_dim=96,
    moe_inter_dim=32,
    moe_args=MoEArgs(
        num_experts=4, num_shared_experts=1, top_k=2, score_func="softmax", score_before_experts=False
    ),
    q_lora_rank=0,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    max_seq_len=32,
)


def _counts(flavor: str) -> tuple[int, int, int]:
    """(total, active, active without the input embedding), built on the meta device."""
    with torch.device("meta"):
        model = DeepSeekV3Model(deepseek_v3_args(flavor, eos_id=0))
    return (
        count_parameters(model),
        count_active_parameters(model),
        count_active_parameters(model, exclude_embedding=True),
    )


# Published: DeepSeek-V3 671B total / 37B activated; DeepSeek-V2 236B / 21B; DeepSeek-V2-Lite 15.7B / 2.4B.
# Totals include the embedding and output matrices. "Activated" leaves out the input embedding (a lookup)
# and keeps the output head: 36.6B -> 37B, 20.9B -> 21B, 2.45B -> 2.4B (V2-Lite's figure is truncated;
# with the embedding the counts would read 38B, 21B, 2.7B). No multi-token-prediction layer is counted.
@pytest.mark.parametrize(
    "flavor, total_b, active_b, digits, exact",
    [
        ("671B", 671, 37, 0, (671_026_404_352, 37_552_282_624)),
        ("236B", 236, 21, 0, (235_741_434_880, 21_375_800_320)),
        ("16B", 15.7, 2.4, 1, (15_706_484_224, 2_661_150_208)),
    ],
)
def test_flavor_parameter_counts_match_the_published_figures(flavor, total_b, active_b, digits, exact):
    total, active, active_no_embedding = _counts(flavor)
    assert round(total / 1e9, digits) == total_b
    if flavor == "16B":
        assert int(active_no_embedding / 1e8) / 10 == active_b
    else:
        assert round(active_no_embedding / 1e9, digits) == active_b
    assert (total, active) == exact


def test_flops_per_token_count_active_parameters_and_mla_attention():
    with torch.device("meta"):
        model = DeepSeekV3Model(TINY)
    active = count_active_parameters(model)
    embedding = model.tok_embeddings.weight.numel()
    routed = sum(model.layers[str(i)].moe.experts.w1.numel() * 3 for i in (1, 2))
    assert count_parameters(model) - active == routed // 2  # top 2 of 4 experts
    flops = deepseek_flops_per_token(TINY, active, embedding, seq_len=32)
    assert flops == 6 * (active - embedding) + 6 * 3 * 4 * (24 + 12) * 32


def test_init_depends_on_the_seed_only():
    with torch.device("meta"):
        meta = DeepSeekV3Model(TINY)
    meta.to_empty(device="cpu")
    meta.init_weights(seed=3)
    direct = DeepSeekV3Model(TINY)
    direct.init_weights(seed=3)
    other = DeepSeekV3Model(TINY)
    other.init_weights(seed=4)
    for (name, a), b, c in zip(
        meta.state_dict().items(), direct.state_dict().values(), other.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
        if not name.endswith(("norm.weight", "expert_bias")):
            assert not torch.equal(a, c), name
    assert meta.layers["1"].moe.experts.w2.std() < meta.layers["1"].moe.experts.w1.std()  # depth-scaled


def test_pipeline_stages_compose_to_the_whole_model():
    args = replace(TINY, attn_mask_type="block_causal", eos_id=1)
    whole = DeepSeekV3Model(args)
    whole.init_weights(seed=0)
    tokens = torch.randint(2, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    tokens[:, 5] = 1
    units = whole.pipeline_units()
    assert units == ["tok_embeddings", "layers.0", "layers.1", "layers.2", "norm", "output"]
    first, second = DeepSeekV3Model(args), DeepSeekV3Model(args)
    for stage in (first, second):
        stage.load_state_dict(whole.state_dict())
    del first.layers["2"]
    first.norm = first.output = None
    del second.layers["0"], second.layers["1"]
    second.tok_embeddings = None
    from titan_models import document_ids

    out = second(first(tokens), doc_ids=document_ids(tokens, 1))
    torch.testing.assert_close(out, whole(tokens), atol=1e-6, rtol=1e-6)
    assert list(second.moe_layers()) == ["layers.2.moe"]
    assert [b.shape for b, _ in whole.sequence_buffers()] == [torch.Size([32, 4])]


def test_block_causal_attention_keeps_packed_documents_apart():
    args = replace(TINY, attn_mask_type="block_causal", eos_id=1)
    model = DeepSeekV3Model(args)
    model.init_weights(seed=0)
    doc_a = torch.randint(2, 128, (1, 6), generator=torch.Generator().manual_seed(1))
    doc_a[0, -1] = 1
    doc_b = torch.randint(2, 128, (1, 10), generator=torch.Generator().manual_seed(2))
    packed = model(torch.cat([doc_a, doc_b], dim=1))
    torch.testing.assert_close(packed[:, 6:], model(doc_b), atol=1e-5, rtol=1e-5)


def test_expert_bias_update_and_load_over_the_whole_model():
    model = DeepSeekV3Model(TINY)
    model.init_weights(seed=0)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    loads = expert_load(model)
    assert set(loads) == {"layers.1.moe", "layers.2.moe"} and all(v >= 1.0 for v in loads.values())
    update_expert_bias(model)
    assert all(m.tokens_per_expert.sum() == 0 for m in model.moe_layers().values())
    assert any(m.expert_bias.abs().sum() > 0 for m in model.moe_layers().values())


def test_yarn_applies_beyond_the_original_length_as_torchtitan_does():
    args = deepseek_v3_args("debugmodel", max_seq_len=2048)
    assert not args.uses_yarn and args.softmax_scale == pytest.approx(192**-0.5)
    long = deepseek_v3_args("debugmodel", max_seq_len=8192)
    m = 0.1 * 0.70 * torch.log(torch.tensor(40.0)).item() + 1
    assert long.uses_yarn and long.softmax_scale == pytest.approx(192**-0.5 * m * m)
    short, stretched = (
        DeepSeekV3Model(replace(TINY, yarn=False)),
        DeepSeekV3Model(replace(TINY, yarn=True, original_seq_len=16)),
    )
    # The lowest frequency is divided by rope_factor; the highest kept.
    ratio = short.freqs_cis.angle()[1] / stretched.freqs_cis.angle()[1]
    assert ratio[0] == pytest.approx(1.0) and ratio[-1] == pytest.approx(40.0)


@pytest.mark.parametrize(
    "bad, field",
    [
        (dict(n_dense_layers=4), "n_dense_layers"),
        (dict(attn_backend="varlen"), "attn_backend"),
        (dict(qk_rope_head_dim=7), "qk_rope_head_dim"),
        (dict(q_lora_rank=-1), "q_lora_rank"),
    ],
)
def test_bad_arguments_are_refused_naming_the_field(bad, field):
    with pytest.raises(ModelConfigError, match=field):
        replace(TINY, **bad)


def test_flavors_have_torchtitans_names():
    torchtitans = ["debugmodel", "debugmodel_flex_attn", "16B", "236B", "671B"]
    assert list(DEEPSEEK_V3_FLAVORS) == [*torchtitans, "kimi_k2", "kimi_k2_debugmodel"]
    with pytest.raises(ModelConfigError, match="debugmodel"):
        deepseek_v3_args("7B")


def test_kimi_k2_has_the_published_size_and_its_debug_model_its_structure():
    """Kimi K2's model card: 1T parameters in total, 32B activated (the input embedding left out, as for
    DeepSeek's figures above), 61 layers of which 1 dense, 384 experts, 8 a token, 1 shared, 64 heads.
    Its published config.json as the named flavor: packages/titan-train/tests/test_hf_published_formats.py.
    The debug flavor keeps every structural choice and shrinks only the widths and counts."""
    total, active, active_no_embedding = _counts("kimi_k2")
    assert (round(total / 1e12), round(active_no_embedding / 1e9)) == (1, 32)
    assert (total, active) == (1_026_408_209_408, 32_861_477_888)
    kimi, debug = DEEPSEEK_V3_FLAVORS["kimi_k2"], DEEPSEEK_V3_FLAVORS["kimi_k2_debugmodel"]
    m = kimi.moe_args
    assert (
        kimi.n_layers,
        kimi.n_dense_layers,
        kimi.n_heads,
        m.num_experts,
        m.top_k,
        m.num_shared_experts,
    ) == (
        61,
        1,
        64,
        384,
        8,
        1,
    )
    same = (
        "n_dense_layers",
        "rope_theta",
        "rope_factor",
        "original_seq_len",
        "beta_fast",
        "beta_slow",
        "mscale",
    )
    same += ("yarn", "norm_eps", "latent_norm_eps", "final_norm_eps")
    assert all(getattr(debug, f) == getattr(kimi, f) for f in same)
    routing = ("score_func", "route_norm", "route_scale", "score_before_experts", "num_shared_experts")
    assert all(getattr(debug.moe_args, f) == getattr(m, f) for f in routing)
    assert debug.moe_args.num_expert_groups is m.num_expert_groups is None and debug.q_lora_rank > 0
    model = DeepSeekV3Model(replace(debug, max_seq_len=16))
    model.init_weights(seed=0)
    tokens = torch.randint(0, debug.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    assert logits.shape == (2, 16, debug.vocab_size) and model.layers["1"].moe.experts.w1.grad is not None
