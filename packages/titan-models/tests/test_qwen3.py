"""Qwen3's sizes against the published figures, and its model contract (init, MoE layers, training step)."""

import pytest
import torch
from family_checks import materialised
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from titan_models import ModelConfigError, count_parameters
from titan_models.moe import count_active_parameters
from titan_models.qwen3 import (
    QWEN3_FLAVORS,
    Qwen3Args,
    Qwen3Model,
    moe_flops_per_token,
    qwen3_args,
    qwen3_moe_args,
)

# Published by Qwen (model cards of Qwen/Qwen3-*), in billions: (total, non-embedding, active).
# The non-embedding figure leaves out the embedding and, where untied, the output matrix too.
PUBLISHED = {
    "0.6B": (0.6, 0.44, None),
    "1.7B": (1.7, 1.4, None),
    "4B": (4.0, 3.6, None),
    "8B": (8.2, 6.95, None),
    "14B": (14.8, 13.2, None),
    "32B": (32.8, 31.2, None),
    "30B-A3B": (30.5, 29.9, 3.3),
    "235B-A22B": (235.0, 234.0, 22.0),
}


def _meta(args):
    with torch.device("meta"):
        return Qwen3Model(args)


def _precision(figure: float) -> float:
    """Half a unit of the figure's last published digit (6.95 -> 0.005, 235.0 -> 0.5)."""
    text = f"{figure:g}"
    decimals = len(text.split(".")[1]) if "." in text else 0
    return 0.5 * 10**-decimals


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_parameter_counts_match_the_published_figures(flavor):
    args = QWEN3_FLAVORS[flavor]
    model = _meta(args)
    total = count_parameters(model)
    output = 0 if args.tie_word_embeddings else args.vocab_size * args.dim
    non_embedding = count_parameters(model, exclude_embedding=True) - output
    published_total, published_non_embedding, published_active = PUBLISHED[flavor]
    assert abs(total / 1e9 - published_total) <= _precision(published_total)
    assert abs(non_embedding / 1e9 - published_non_embedding) <= _precision(published_non_embedding)
    active = count_active_parameters(model)
    if published_active is None:
        assert active == total
    else:
        # Embeddings count as active. 30B-A3B has 3.35B active; Qwen writes 3.3B (truncated, not rounded).
        assert published_active <= active / 1e9 < published_active + 2 * _precision(published_active)


def test_flops_per_token_count_the_active_parameters_and_attention():
    args = QWEN3_FLAVORS["30B-A3B"]
    model = _meta(args)
    active = count_active_parameters(model)
    embedding = args.vocab_size * args.dim
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * 4096
    assert moe_flops_per_token(args, model, seq_len=4096) == 6 * (active - embedding) + attention


def _tiny(**kw) -> Qwen3Args:
    base = dict(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=96, hidden_dim=96, max_seq_len=32
    )
    return Qwen3Args(**{**base, **kw})


def _built(args, seed=1):
    return materialised(Qwen3Model, args, seed)


@pytest.mark.parametrize("moe", [False, True])
def test_init_depends_on_the_seed_only_and_not_on_which_blocks_a_stage_holds(moe):
    args = _tiny(moe_inter_dim=32, moe_args=qwen3_moe_args(4, 2)) if moe else _tiny()
    full = _built(args)
    stage = _meta(args)
    del stage.layers["0"]  # a pipeline stage holding only block 1
    stage.tok_embeddings = None
    stage.to_empty(device="cpu")
    stage.init_weights(seed=1)
    for name, tensor in stage.state_dict().items():
        assert torch.equal(tensor, full.state_dict()[name]), name
    other = _built(args, seed=2)
    assert not torch.equal(other.layers["1"].attention.wq.weight, full.layers["1"].attention.wq.weight)
    if moe:
        assert set(full.moe_layers()) == {"layers.0.moe", "layers.1.moe"}
        assert set(stage.moe_layers()) == {"layers.1.moe"}
        assert torch.count_nonzero(full.layers["0"].moe.expert_bias) == 0


def test_moe_training_step_reaches_every_routed_expert_and_the_qk_norms():
    args = _tiny(moe_inter_dim=32, moe_args=qwen3_moe_args(4, 2))
    model = _built(args)
    tokens = torch.randint(0, args.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten())
    loss.backward()
    experts = model.layers["0"].moe.experts
    assert all(experts.w1.grad[e].abs().sum() > 0 for e in range(4))
    assert model.layers["1"].attention.q_norm.weight.grad.abs().sum() > 0
    assert model.layers["0"].moe.tokens_per_expert.sum() == 4 * 32 * 2


def test_tied_flavors_tie_shard_the_vocabulary_under_tp_and_refuse_pipeline_parallelism():
    model = _built(_tiny(tie_word_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight
    # Both ends of the tied matrix split the vocabulary (dim 0), so tensor parallelism can keep it one
    # parameter; a pipeline puts them on different ranks, which one parameter cannot span.
    plan = model.tp_plan()
    assert isinstance(plan["tok_embeddings"], RowwiseParallel)  # an embedding's weight split on dim 0
    assert isinstance(plan["output"], ColwiseParallel)  # a linear's weight (vocab, dim) split on dim 0
    with pytest.raises(ModelConfigError, match="tie"):
        model.pipeline_units()


def test_unknown_flavor_and_bad_shapes_are_refused_in_one_line():
    with pytest.raises(ModelConfigError, match="unknown qwen3 flavor '7B'"):
        qwen3_args("7B")
    with pytest.raises(ModelConfigError, match=r"n_heads \(4\) must be divisible by n_kv_heads \(3\)"):
        _tiny(n_kv_heads=3)
