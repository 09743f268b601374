"""Generation with the KV cache: against transformers' `generate`, against recomputing every position,
and the sampling and stopping rules; the MoE families' cache against their own training forward here
(block-causal documents included), against transformers in test_generation_moe_hf.py."""

from dataclasses import replace

import pytest
import torch
from family_checks import materialised, perturb
from transformers import LlamaConfig, LlamaForCausalLM

from titan_models import (
    KVCache,
    LlamaStateDictAdapter,
    ModelArgs,
    ModelError,
    RopeScaling,
    SamplingParams,
    Transformer,
    forward_cached,
    generate,
    llama3_args,
    sample_next,
)
from titan_models.deepseek_v3 import DEEPSEEK_V3_FLAVORS, DeepSeekV3Model
from titan_models.flavors import LLAMA31_ROPE_SCALING
from titan_models.generation import has_kv_cache
from titan_models.llama4 import LLAMA4_FLAVORS, Llama4Model
from titan_models.qwen3 import Qwen3Args, Qwen3Model, qwen3_moe_args

SHAPES = {
    # Grouped-query attention and Llama 3.1's rotary stretch, its original context short enough that the
    # kept, divided and blended frequency bands all occur within the 39 positions generated over.
    "tiny-gqa-rope-scaled": ModelArgs(
        dim=64,
        n_layers=2,
        n_heads=8,
        n_kv_heads=2,
        vocab_size=96,
        multiple_of=32,
        rope_theta=500000,
        max_seq_len=64,
        rope_scaling=RopeScaling(original_max_seq_len=32),
    ),
    # The debug flavor's shape (dim 256, 6 layers, 16 heads, vocabulary 2048), with the 3.1 scaling.
    "debug-shaped": ModelArgs(
        **{**llama3_args("debugmodel").__dict__, "max_seq_len": 64, "rope_scaling": LLAMA31_ROPE_SCALING}
    ),
}


def _hf_and_ours(args: ModelArgs, seed: int = 0) -> tuple[LlamaForCausalLM, Transformer]:
    """The same random weights in transformers' Llama and ours. Embeddings of std 1 and other weights
    of std 0.3 give varied greedy continuations with clear margins between the top two logits."""
    adapter = LlamaStateDictAdapter(args)
    # No end-of-sequence id (LlamaConfig's default is 2): both sides generate every token greedily.
    config = LlamaConfig(**{"bos_token_id": None, "eos_token_id": None, **adapter.hf_config()})
    hf = LlamaForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            base, std = (1.0, 0.1) if "norm" in name else (0.0, 1.0 if "embed" in name else 0.3)
            p.copy_(base + std * torch.randn(p.shape, generator=gen))
    ours = Transformer(args).eval()
    ours.load_state_dict(adapter.from_hf(hf.state_dict()))
    return hf, ours


def _prompts(vocab: int, lengths: tuple[int, ...], seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.slow
@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_32_tokens_equal_transformers_generate(shape):
    args = SHAPES[shape]
    hf, ours = _hf_and_ours(args)
    prompts = _prompts(args.vocab_size, (7, 3, 11) if shape == "tiny-gqa-rope-scaled" else (7, 3))
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt])  # the mask given: transformers would take id 0 for padding
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False, pad_token_id=0
        )
        expected.append(out[0, len(prompt) :].tolist())
    assert all(len(set(tokens)) >= 8 for tokens in expected)  # varied text, not one repeated token

    alone = generate(ours, prompts[:1], SamplingParams(max_new_tokens=32))  # one row: no mask at all
    assert alone.tokens == expected[:1]
    batched = generate(ours, prompts, SamplingParams(max_new_tokens=32))  # left-padded rows, masked
    assert batched.tokens == expected and batched.finish_reasons == ["length"] * len(prompts)

    if shape == "tiny-gqa-rope-scaled":  # transformers' own left-padded batch agrees too
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        hf_batched = hf.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=0)
        assert hf_batched[:, width:].tolist() == expected


def _recompute_check(model: Transformer, prompts: list[list[int]], steps: int) -> None:
    """Each step's cached logits equal the training forward over the whole sequence so far, per row."""
    width = max(map(len, prompts))
    cache = KVCache.for_model(model, len(prompts), width + steps)
    tokens = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    valid = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in prompts])
    sequences = [list(p) for p in prompts]
    logits = forward_cached(model, tokens, cache, valid)
    worst, scale = 0.0, 0.0
    for _ in range(steps):
        with torch.no_grad():
            full = torch.stack([model(torch.tensor([s]))[0, -1] for s in sequences])
        worst, scale = max(worst, (logits - full).abs().max().item()), max(scale, full.abs().max().item())
        nxt = logits.argmax(-1)
        for row, token in enumerate(nxt.tolist()):
            sequences[row].append(token)
        logits = forward_cached(model, nxt[:, None], cache)
    print(f"largest logit {scale:.1f}, largest difference {worst:.2e}")
    assert worst <= 5e-6 * scale, (worst, scale)  # float32 rounding: another summation order


@pytest.mark.slow
def test_cache_path_equals_recomputing_the_whole_sequence_each_step():
    args = SHAPES["tiny-gqa-rope-scaled"]
    _, model = _hf_and_ours(args)
    _recompute_check(model, _prompts(args.vocab_size, (5, 12, 1)), steps=16)


@pytest.mark.slow
def test_block_causal_cache_keeps_documents_apart_like_the_training_forward():
    args = ModelArgs(
        **{**SHAPES["tiny-gqa-rope-scaled"].__dict__, "attn_mask_type": "block_causal", "eos_id": 7}
    )
    _, model = _hf_and_ours(args)
    prompts = [[3, 4, 7, 9, 10, 11], [5, 7, 7, 2], [1, 2, 3]]  # end-of-text inside the first two prompts
    _recompute_check(model, prompts, steps=12)


@pytest.mark.slow
def test_seeded_sampling_repeats_and_top_k_top_p_limit_the_choice():
    args = SHAPES["tiny-gqa-rope-scaled"]
    _, model = _hf_and_ours(args)
    prompts = _prompts(args.vocab_size, (4, 6))
    greedy = generate(model, prompts, SamplingParams(max_new_tokens=16)).tokens

    def sampled(**kw):
        return generate(model, prompts, SamplingParams(max_new_tokens=16, **kw)).tokens

    hot = dict(temperature=1.5, seed=3)
    assert sampled(**hot) == sampled(**hot)
    assert sampled(**hot) != sampled(temperature=1.5, seed=4) != greedy
    assert sampled(top_k=1, **hot) == greedy
    assert sampled(top_p=1e-6, **hot) == greedy

    logits = torch.tensor([[0.0, 3.0, 2.9, 1.0, -1.0]]).repeat(2000, 1)
    gen = torch.Generator().manual_seed(0)
    top2 = sample_next(logits, SamplingParams(temperature=1.0, top_k=2), gen)
    assert set(top2.tolist()) == {1, 2}
    # top_p: probabilities 0.474, 0.429, 0.064, 0.024, ...: 0.5 keeps the two most likely, 0.95 three.
    assert set(sample_next(logits, SamplingParams(temperature=1.0, top_p=0.5), gen).tolist()) == {1, 2}
    assert set(sample_next(logits, SamplingParams(temperature=1.0, top_p=0.95), gen).tolist()) == {1, 2, 3}


def test_row_seeds_draw_each_row_as_it_draws_alone_or_in_another_batch():
    """One seed per row: a row samples the same tokens in any batch, alone, reordered or recomputed (what lets
    ranks that split a batch draw what one process draws). Planted (2026-12-03): one generator seeded with the
    first row's seed for the whole batch failed it."""
    args = SHAPES["tiny-gqa-rope-scaled"]
    _, model = _hf_and_ours(args)
    prompts, seeds = _prompts(args.vocab_size, (4, 6, 5)), (7, 8, 9)
    params = SamplingParams(max_new_tokens=12, temperature=1.5)
    together = generate(model, prompts, replace(params, row_seeds=seeds)).tokens
    alone = [
        generate(model, [p], replace(params, row_seeds=(s,))).tokens[0]
        for p, s in zip(prompts, seeds, strict=True)
    ]
    reordered = generate(model, prompts[::-1], replace(params, row_seeds=seeds[::-1])).tokens[::-1]
    recomputed = generate(model, prompts, replace(params, row_seeds=seeds), kv_cache=False).tokens
    assert together == alone == reordered == recomputed
    assert together != generate(model, prompts, replace(params, row_seeds=(1, 2, 3))).tokens
    with pytest.raises(ModelError, match="1 row_seeds for 3 prompts"):
        generate(model, prompts, replace(params, row_seeds=(1,)))


def test_rows_stop_at_eos_or_a_stop_string_and_the_others_go_on():
    args = SHAPES["tiny-gqa-rope-scaled"]
    _, model = _hf_and_ours(args)
    prompts = _prompts(args.vocab_size, (5, 8))
    free = generate(model, prompts, SamplingParams(max_new_tokens=20)).tokens
    eos = free[0][6]
    assert eos not in free[0][:6]
    stopped = generate(model, prompts, SamplingParams(max_new_tokens=20, eos_ids=(eos,)))
    assert stopped.tokens[0] == free[0][:6] and stopped.finish_reasons[0] == "eos"
    if eos not in free[1]:
        assert stopped.tokens[1] == free[1] and stopped.finish_reasons[1] == "length"

    def decode(ids):
        return "".join(f"<{i}>" for i in ids)

    stop = f"<{free[1][3]}><{free[1][4]}>"
    cut = decode(free[1]).index(stop)
    with_stop = generate(
        model, prompts, SamplingParams(max_new_tokens=20, stop_strings=(stop,)), decode=decode
    )
    assert with_stop.texts[1] == decode(free[1])[:cut] and with_stop.finish_reasons[1] == "stop"
    assert with_stop.tokens[1] == free[1][: len(with_stop.tokens[1])]
    assert with_stop.texts[0] == decode(with_stop.tokens[0])


def test_generation_refuses_what_it_cannot_do():
    args = SHAPES["tiny-gqa-rope-scaled"]
    _, model = _hf_and_ours(args)
    with pytest.raises(ModelError, match="max_seq_len"):
        generate(model, [[1] * 40], SamplingParams(max_new_tokens=30))
    with pytest.raises(ModelError, match="decode"):
        generate(model, [[1]], SamplingParams(stop_strings=("x",)))
    with pytest.raises(ModelError, match="top_p"):
        SamplingParams(top_p=0)
    model.output = None  # a pipeline stage
    with pytest.raises(ModelError, match="whole model"):
        generate(model, [[1]])


_TINY = dict(dim=64, n_layers=2, n_heads=4, vocab_size=96, max_seq_len=48)
# The MoE families in miniature, each with what Llama's attention alone would get wrong: Qwen3's QK norm,
# Llama 4's no-rope layer, chunked and block-causal attention, DeepSeek's latent attention.
MOE_FAMILIES = {
    "qwen3_moe": (
        Qwen3Model,
        Qwen3Args(
            **_TINY, n_kv_heads=2, head_dim=16, hidden_dim=96, moe_inter_dim=32, moe_args=qwen3_moe_args(8, 2)
        ),
    ),
    "llama4_irope": (
        Llama4Model,
        replace(
            LLAMA4_FLAVORS["debugmodel_irope"], **_TINY, every_n_layers_nope=2, attn_chunk_size=8, eos_id=7
        ),
    ),
    "deepseek_v3": (
        DeepSeekV3Model,
        replace(
            DEEPSEEK_V3_FLAVORS["debugmodel"],
            **_TINY,
            n_dense_layers=1,
            inter_dim=96,
            moe_inter_dim=32,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
        ),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_moe_families_cached_batch_generates_what_their_own_forward_chooses(family):
    cls, args = MOE_FAMILIES[family]
    model = materialised(cls, args, seed=0).eval()
    perturb(model, seed=3)
    assert has_kv_cache(model)
    prompts = [[3, 4, 7, 9, 10, 11], [5]]  # different lengths, one batch; 7 ends a document (Llama 4)
    got = generate(model, prompts, SamplingParams(max_new_tokens=8)).tokens
    with torch.no_grad():
        for prompt, tokens in zip(prompts, got, strict=True):
            assert len(tokens) == 8
            logits = model(torch.tensor([prompt + tokens]))[0, len(prompt) - 1 : -1]
            assert torch.equal(logits.argmax(-1), torch.tensor(tokens)), (family, prompt)
    with pytest.raises(ModelError, match="max_seq_len"):
        generate(model, [[1] * 40], SamplingParams(max_new_tokens=10))
    with pytest.raises(ModelError, match="max_seq_len"):
        generate(model, [[1] * 40], SamplingParams(max_new_tokens=10), kv_cache=False)


def test_ranks_stepping_together_step_until_every_rank_is_done_and_keep_their_own_tokens():
    """`all_done`: a batch whose rows all ended steps on while another rank's have not (its forwards would
    otherwise leave that rank's all-to-alls waiting), and still returns the tokens it returns alone. The other
    rank is played by an `all_done` that holds out for 9 steps. Planted: the loop breaking on this batch's own
    rows (all_done ignored) failed the step count."""
    args = SHAPES["tiny-gqa-rope-scaled"]
    _, model = _hf_and_ours(args)
    prompts = _prompts(args.vocab_size, (4, 6))
    params = SamplingParams(max_new_tokens=12, temperature=1.5, row_seeds=(7, 8))
    first = generate(model, prompts, params)
    ends = tuple(sorted({tokens[1] for tokens in first.tokens}))  # every row ends at its second token
    alone = generate(model, prompts, replace(params, eos_ids=ends))
    asked: list[bool] = []

    def other_rank_done_at_step_9(mine: bool) -> bool:
        asked.append(mine)
        return mine and len(asked) >= 9

    together = generate(model, prompts, replace(params, eos_ids=ends), all_done=other_rank_done_at_step_9)
    assert alone.steps <= 2 and together.steps == 9 and asked[-1]
    assert together.tokens == alone.tokens and together.end_ids == alone.end_ids
    with pytest.raises(ModelError, match="need the KV cache"):
        generate(model, prompts, params, kv_cache=False, all_done=other_rank_done_at_step_9)
