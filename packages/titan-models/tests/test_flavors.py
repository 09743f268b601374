"""Published flavor shapes, parameter counts on the meta device, and FLOPs per token."""

import pytest
import torch

from titan_models import (
    LLAMA2_FLAVORS,
    LLAMA3_FLAVORS,
    ModelConfigError,
    Transformer,
    count_parameters,
    flops_per_token,
    llama2_args,
    llama3_args,
)


def _on_meta(args) -> Transformer:
    with torch.device("meta"):
        return Transformer(args)


@pytest.mark.parametrize(
    "family, flavor, expected",
    [
        ("llama3", "8B", 8_030_261_248),
        ("llama3", "70B", 70_553_706_496),
        ("llama3", "405B", 405_853_388_800),
        ("llama2", "7B", 6_738_415_616),
        ("llama2", "13B", 13_015_864_320),
        ("llama2", "70B", 68_976_648_192),
        # Llama 3.2, tied embeddings: the shared matrix counts once.
        ("llama3", "1B", 1_235_814_400),
        ("llama3", "3B", 3_212_749_824),
        ("llama3", "debugmodel", 6_163_712),
    ],
)
def test_flavor_counts_published_parameters_on_meta_device(family, flavor, expected):
    args = (llama3_args if family == "llama3" else llama2_args)(flavor)
    assert count_parameters(_on_meta(args)) == expected


def test_families_have_their_published_vocabulary_and_rotary_base():
    # The published sizes (1B ... 405B and their attention variants); other tests register small flavors
    # of their own into the same table.
    for name, args in LLAMA3_FLAVORS.items():
        if name[0].isdigit():
            assert (args.vocab_size, args.rope_theta) == (128256, 500000), name
    for name in ("7B", "13B", "70B"):
        assert (LLAMA2_FLAVORS[name].vocab_size, LLAMA2_FLAVORS[name].rope_theta) == (32000, 10000)
        assert LLAMA2_FLAVORS[name].rope_scaling is None
    scaling = LLAMA3_FLAVORS["405B"].rope_scaling
    assert (
        scaling.factor,
        scaling.low_freq_factor,
        scaling.high_freq_factor,
        scaling.original_max_seq_len,
    ) == (8.0, 1.0, 4.0, 8192)
    assert LLAMA3_FLAVORS["1B"].tie_word_embeddings and not LLAMA3_FLAVORS["8B"].tie_word_embeddings


def test_counting_without_embeddings_leaves_out_the_embedding_matrix():
    model = _on_meta(llama3_args("8B"))
    assert count_parameters(model) - count_parameters(model, exclude_embedding=True) == 128256 * 4096


def test_flops_per_token_is_6n_plus_attention():
    args = llama3_args("8B")
    model = _on_meta(args)
    n = count_parameters(model)
    emb = n - count_parameters(model, exclude_embedding=True)
    expected = 6 * (n - emb) + 12 * 32 * 32 * 128 * 8192
    assert flops_per_token(args, n, emb, 8192) == expected


def test_flops_of_a_tied_model_still_count_the_output_projection():
    args = llama3_args("1B")
    model = _on_meta(args)
    n = count_parameters(model)
    emb = n - count_parameters(model, exclude_embedding=True)
    matmul_params = n  # the one matrix is the (free) lookup and the (costly) output projection
    assert flops_per_token(args, n, emb, 2048) == 6 * matmul_params + 12 * 16 * 32 * 64 * 2048


def test_unknown_flavor_lists_the_known_ones():
    with pytest.raises(
        ModelConfigError, match="unknown llama2 flavor '8B'; choose one of debugmodel, 7B, 13B, 70B"
    ):
        llama2_args("8B")
