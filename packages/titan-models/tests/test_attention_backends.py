"""Attention backends and masks: block-causal over packed documents, CPU fallback, flash-attn refusal."""

from dataclasses import replace

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask

from titan_models import (
    BackendUnavailableError,
    ModelArgs,
    ModelConfigError,
    ModelError,
    Transformer,
    document_ids,
    llama3_args,
)
from titan_models.attention_masks import VarlenMask, build_attention_mask, varlen_mask

EOS = 1
ARGS = ModelArgs(
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=64,
    multiple_of=32,
    rope_theta=500000,
    max_seq_len=32,
    eos_id=EOS,
    attn_backend="flex",
    attn_mask_type="block_causal",
)


def _model(args: ModelArgs) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=7)
    return model


def _packed_documents(lengths: list[int], seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A packed row of documents that each end with EOS, and the documents alone."""
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.cat([torch.randint(2, 64, (n - 1,), generator=gen), torch.tensor([EOS])]) for n in lengths]
    return torch.cat(docs)[None], [d[None] for d in docs]


def test_document_ids_advance_after_each_end_of_text():
    tokens = torch.tensor([[5, 6, EOS, 7, EOS, EOS, 8]])
    assert document_ids(tokens, EOS).tolist() == [[0, 0, 0, 1, 1, 2, 3]]


def test_block_causal_flex_attention_over_packed_documents_equals_each_document_alone():
    model = _model(ARGS)
    packed, docs = _packed_documents([9, 14, 5, 4], seed=0)
    with torch.no_grad():
        # Without autograd, flex attention itself runs on CPU (its forward exists here).
        assert isinstance(build_attention_mask(ARGS, document_ids(packed, EOS), "cpu"), BlockMask)
        together = model(packed)
        alone = torch.cat([model(doc) for doc in docs], dim=1)
    assert (together - alone).abs().max().item() < 1e-5
    # Attending across the boundary would change the second document's logits.
    causal = _model(replace(ARGS, attn_mask_type="causal"))(packed).detach()
    assert (causal[:, 9:] - alone[:, 9:]).abs().max().item() > 1e-3


@pytest.mark.parametrize("backend", ["flex", "sdpa"])
def test_block_causal_training_on_cpu_gives_each_documents_own_gradients(backend):
    args = replace(ARGS, attn_backend=backend)
    packed, docs = _packed_documents([11, 6, 15], seed=1)
    model = _model(args)
    # With autograd on CPU, flex falls back to SDPA with an explicit boolean block-causal mask.
    assert build_attention_mask(args, document_ids(packed, EOS), "cpu").dtype == torch.bool
    model(packed).square().sum().backward()
    together = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for doc in docs:
        model(doc).square().sum().backward()
    for got, expected in zip(together, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mask_type", ["block_causal", "causal"])
def test_flex_and_its_cpu_fallback_give_the_same_logits(mask_type):
    model = _model(replace(ARGS, attn_mask_type=mask_type))
    packed, _ = _packed_documents([7, 10, 15], seed=2)
    with torch.no_grad():
        flex = model(packed)
    fallback = model(packed)  # autograd on: the SDPA path
    assert (flex - fallback).abs().max().item() < 1e-5


def test_flex_flavors_are_block_causal_and_train_on_cpu():
    for flavor in ("debugmodel_flex_attn", "8B_flex_attn"):
        args = llama3_args(flavor)
        assert (args.attn_backend, args.attn_mask_type) == ("flex", "block_causal")
    model = _model(replace(llama3_args("debugmodel_flex_attn"), eos_id=EOS, max_seq_len=16))
    tokens = torch.randint(2, 2048, (2, 16))
    tokens[:, 5] = EOS
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_varlen_mask_gives_each_document_of_the_flattened_batch_its_start():
    tokens = torch.tensor([[5, EOS, 6, 7], [8, 9, EOS, EOS]])
    mask = varlen_mask(document_ids(tokens, EOS))
    # Row 0: [5 EOS] [6 7]; row 1 starts a document at flat index 4: [8 9 EOS] [EOS].
    assert mask.cu_seqlens.tolist() == [0, 2, 4, 7, 8] and mask.cu_seqlens.dtype == torch.int32
    assert (mask.max_seqlen, mask.seq_len) == (3, 4)


def test_varlen_attention_equals_block_causal_attention_forward_and_backward():
    """The varlen flavor trains exactly as block-causal SDPA: logits and every gradient, batch of 3 rows."""
    flavor = llama3_args("debugmodel_varlen_attn")
    assert (flavor.attn_backend, flavor.attn_mask_type) == ("varlen", "block_causal")
    args = replace(ARGS, attn_backend="varlen")
    rows = [
        _packed_documents(lengths, seed)[0] for seed, lengths in enumerate([[9, 14, 5, 4], [32], [1, 30, 1]])
    ]
    tokens = torch.cat(rows)
    assert isinstance(build_attention_mask(args, document_ids(tokens, EOS), "cpu"), VarlenMask)
    results = []
    for model in (_model(args), _model(replace(ARGS, attn_backend="sdpa"))):
        logits = model(tokens)
        logits.square().sum().backward()
        results.append((logits.detach(), [p.grad for p in model.parameters()]))
    (varlen, varlen_grads), (block_causal, block_causal_grads) = results
    torch.testing.assert_close(varlen, block_causal, rtol=1e-6, atol=1e-6)
    for got, expected in zip(varlen_grads, block_causal_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # Plain causal attention crosses the documents: far from what varlen gives.
    causal = _model(replace(ARGS, attn_mask_type="causal"))(tokens).detach()
    assert (causal - varlen).abs().max().item() > 1e-3


def test_varlen_attention_needs_block_causal_documents():
    with pytest.raises(ModelConfigError, match="attn_mask_type='block_causal'"):
        _model(replace(ARGS, attn_backend="varlen", attn_mask_type="causal"))


def test_a_pipeline_stage_without_embeddings_takes_document_ids_from_the_caller():
    model = _model(ARGS)
    packed, _ = _packed_documents([12, 20], seed=3)
    expected = model(packed)
    hidden = model.tok_embeddings(packed)
    model.tok_embeddings = None
    with pytest.raises(ModelError, match=r"doc_ids=model\.packed_document_ids\(tokens\)"):
        model(hidden)
    assert torch.equal(model.packed_document_ids(packed), document_ids(packed, EOS))
    torch.testing.assert_close(model(hidden, doc_ids=document_ids(packed, EOS)), expected, rtol=0, atol=0)


def test_asking_for_flash_attn_here_fails_at_build_saying_how_to_install():
    with pytest.raises(
        BackendUnavailableError, match=r"not installed.*CUDA GPU.*pip install 'titan-models\[flash\]'"
    ):
        with torch.device("meta"):
            Transformer(replace(ARGS, attn_backend="flash", attn_mask_type="causal"))


def test_block_causal_without_an_eos_id_fails_at_build():
    with pytest.raises(ModelConfigError, match="needs eos_id"):
        Transformer(replace(ARGS, eos_id=None))


def test_unknown_backend_or_mask_type_is_named_in_the_error():
    with pytest.raises(ModelConfigError, match="attn_backend 'xformers'.*sdpa, flex, flash"):
        replace(ARGS, attn_backend="xformers")
    with pytest.raises(ModelConfigError, match="attn_mask_type 'sliding'"):
        replace(ARGS, attn_mask_type="sliding")
