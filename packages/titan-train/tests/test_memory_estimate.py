"""The analytic memory estimate against exact arithmetic and against what autograd really keeps."""

import pytest
import torch
import torch.nn.functional as F

from titan_models import Transformer, count_parameters, llama3_args
from titan_parallel import blocks_of
from titan_train.config import load_job_config
from titan_train.memory_estimate import ParamCounts, estimate_memory_per_rank, saved_elements_per_token

ONE_RANK = {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1}


def _counts(args) -> ParamCounts:
    with torch.device("meta"):
        model = Transformer(args)
    embedding = count_parameters(model) - count_parameters(model, exclude_embedding=True)
    return ParamCounts.of(model, blocks_of(model), embedding)


def test_parameter_gradient_and_adam_bytes_shard_over_fsdp_ranks():
    args = llama3_args("8B")
    counts = _counts(args)
    assert counts.total == 8_030_261_248 and counts.n_blocks == 32
    config = load_job_config(["--model.flavor", "8B"])
    estimate = estimate_memory_per_rank(config, args, {**ONE_RANK, "dp_shard": 64}, counts)
    assert estimate.parameters == round(counts.total * 4 / 64)
    assert estimate.gradients == estimate.parameters
    assert estimate.optimizer_state == 2 * estimate.parameters
    bf16 = estimate_memory_per_rank(
        load_job_config(["--model.flavor", "8B", "--training.dtype", "bfloat16"]),
        args,
        {**ONE_RANK, "dp_shard": 64},
        counts,
    )
    assert bf16.parameters == pytest.approx(estimate.parameters / 2, abs=1)


def test_activation_checkpointing_modes_order_activation_memory():
    args = llama3_args("8B")
    kv = args.kv_heads * args.head_dim

    def saved(mode, option="2"):
        return saved_elements_per_token(args.dim, kv, args.ffn_hidden_dim, mode, option, 0.5)

    per_token = {
        "none": saved("none"),
        "every 2nd": saved("selective", "2"),
        "op": saved("selective", "op"),
        "full": saved("full"),
    }
    assert per_token["none"] > per_token["every 2nd"] > per_token["op"] > per_token["full"] == args.dim


def test_activation_estimate_matches_the_tensors_autograd_saves():
    torch.manual_seed(0)
    args = llama3_args("debugmodel")
    args.max_seq_len = 64
    model = Transformer(args)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (2, 64))
    saved: dict[int, int] = {}

    def keep(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    measured = sum(size for ptr, size in saved.items() if ptr not in weights)

    config = load_job_config(
        ["--activation_checkpoint.mode", "none", "--training.seq_len", "64", "--training.local_batch_size", "2",
         "--training.mixed_precision_param", "float32"]
    )  # fmt: skip
    estimate = estimate_memory_per_rank(config, args, ONE_RANK, _counts(args))
    assert estimate.activations == pytest.approx(measured, rel=0.15)
