"""Llama 4's sizes against the published figures, its iRoPE attention and its MoE layout."""

from dataclasses import replace

import pytest
import torch
from family_checks import materialised

from titan_models import ModelConfigError, count_parameters, document_ids
from titan_models.llama4 import (
    LLAMA4_FLAVORS,
    Llama4Args,
    Llama4Model,
    llama4_args,
    llama4_moe_args,
)
from titan_models.llama4.masks import build_llama4_masks
from titan_models.llama4.model import Llama4Attention
from titan_models.moe import count_active_parameters

# Meta's figures (Llama 4 model cards), in billions: total, active per token. They are the multimodal
# checkpoints' and include the vision encoder, which the text model here does not have, so the text
# model's count is compared within 1.5%, and pinned exactly. Embeddings count in both (not tied).
PUBLISHED = {"17bx16e": (109, 17), "17bx128e": (400, 17)}
EXACT = {"17bx16e": (107_769_861_120, 17_172_894_720), "17bx128e": (400_711_848_960, 17_184_691_200)}


@pytest.mark.parametrize(
    "flavor",
    ["17bx16e", "17bx128e", "17bx16e_irope", "17bx128e_irope", "17bx16e_published", "17bx128e_published"],
)
def test_parameter_counts_match_meta_s_published_figures(flavor):
    with torch.device("meta"):
        model = Llama4Model(replace(llama4_args(flavor), eos_id=2))  # block-causal flavors need an eos
    total, active = count_parameters(model), count_active_parameters(model)
    base = flavor.split("_")[0]
    assert (total, active) == EXACT[base]
    published_total, published_active = PUBLISHED[base]
    assert abs(total / 1e9 - published_total) / published_total < 0.015
    assert round(active / 1e9) == published_active


def test_scout_and_maverick_place_moe_and_no_rope_layers_as_published():
    scout, maverick = LLAMA4_FLAVORS["17bx16e_published"], LLAMA4_FLAVORS["17bx128e"]
    assert all(scout.is_moe_layer(i) for i in range(48))
    assert [maverick.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert [scout.uses_rope(i) for i in range(8)] == [True, True, True, False] * 2
    assert (scout.ffn_hidden_dim, scout.moe_hidden_dim) == (16384, 8192)


# torchtitan 0.2.2's flavors (torchtitan/models/llama4/__init__.py and model/args.py at tag v0.2.2):
# every_n_layers_nope=4 with `layer_id % every_n_layers_nope == 0` no-rope, fixed_attn_block_size 8192
# (debugmodel_irope: 256), flex attention, block_causal; its attention has no QK norm and no temperature.
TORCHTITAN_IROPE = {"debugmodel_irope": 256, "17bx16e_irope": 8192, "17bx128e_irope": 8192}


@pytest.mark.parametrize("flavor", list(TORCHTITAN_IROPE))
def test_irope_flavors_compute_torchtitan_s_attention_and_published_ones_meta_s(flavor):
    ours = llama4_args(flavor)
    assert [ours.uses_rope(i) for i in range(8)] == [False, True, True, True] * 2
    assert ours.attn_chunk_size == TORCHTITAN_IROPE[flavor]
    assert (ours.attn_backend, ours.attn_mask_type) == ("flex", "block_causal")
    assert not ours.use_qk_norm and not ours.attn_temperature_tuning
    layers = [Llama4Attention(replace(ours, n_layers=4, eos_id=2), i) for i in range(4)]
    assert all(a.qk_norm_eps is None and not a.tune_temperature for a in layers)
    published = llama4_args(flavor.replace("_irope", "_published"))
    assert [published.uses_rope(i) for i in range(8)] == [True, True, True, False] * 2
    assert published.attn_temperature_tuning and published.use_qk_norm == (flavor != "17bx128e_irope")
    assert published.attn_chunk_size == ours.attn_chunk_size


def _tiny(**kw) -> Llama4Args:
    base = dict(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=96,
        multiple_of=16,
        max_seq_len=32,
        rope_theta=500000.0,
        moe_args=llama4_moe_args(4),
        every_n_layers_nope=2,
        attn_chunk_size=8,
        use_qk_norm=True,
        attn_temperature_tuning=True,
        floor_scale=4,
    )
    return Llama4Args(**{**base, **kw})


def _built(args, seed=1):
    return materialised(Llama4Model, args, seed)


def test_rope_layers_attend_within_their_chunk_and_no_rope_layers_over_everything():
    args = _tiny()
    model = _built(args)
    x = torch.randn(1, 32, args.dim, generator=torch.Generator().manual_seed(0))
    changed = x.clone()
    changed[:, :8] += 1.0  # the first chunk only
    masks = build_llama4_masks(args, None, 32, "cpu")
    rope, nope = model.layers["0"].attention, model.layers["1"].attention
    assert rope.use_rope and not nope.use_rope
    with torch.no_grad():
        assert torch.equal(
            rope(x, model.freqs_cis, masks)[:, 8:], rope(changed, model.freqs_cis, masks)[:, 8:]
        )
        assert not torch.allclose(
            nope(x, model.freqs_cis, masks)[:, 8:], nope(changed, model.freqs_cis, masks)[:, 8:]
        )


def test_block_causal_chunked_training_step_keeps_documents_apart_and_trains_router_and_shared_expert():
    eos = 0
    args = _tiny(attn_backend="flex", attn_mask_type="block_causal", eos_id=eos, interleave_moe_layer_step=2)
    model = _built(args)
    tokens = torch.randint(1, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    tokens[:, 11] = eos  # two documents per row: 0..11 and 12..31
    other = tokens.clone()
    other[:, :11] = (tokens[:, :11] + 1) % (args.vocab_size - 1) + 1
    logits = model(tokens)
    assert torch.allclose(logits[:, 12:], model(other)[:, 12:], atol=1e-6)
    assert torch.equal(document_ids(tokens, eos)[0, 11:13], torch.tensor([0, 1]))
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten()).backward()
    moe = model.layers["1"].moe
    assert set(model.moe_layers()) == {"layers.1.moe", "layers.3.moe"}
    assert moe.router.gate.weight.grad.abs().sum() > 0 and moe.shared_experts.w1.weight.grad.abs().sum() > 0
    assert model.layers["0"].feed_forward.w1.weight.grad.abs().sum() > 0


def test_init_depends_on_the_seed_only():
    args = _tiny()
    one, again, other = _built(args, 3), _built(args, 3), _built(args, 4)
    for name, tensor in one.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[name]), name
    assert not torch.equal(one.layers["1"].moe.experts.w1, other.layers["1"].moe.experts.w1)


def test_bad_shapes_and_unknown_flavors_are_refused_in_one_line():
    with pytest.raises(ModelConfigError, match="every_n_layers_nope"):
        _tiny(every_n_layers_nope=1)
    with pytest.raises(ModelConfigError, match="attn_backend 'varlen'"):
        _tiny(attn_backend="varlen")
    with pytest.raises(ModelConfigError, match="unknown llama4 flavor"):
        llama4_args("17bx32e")
