"""The dry run's memory of Qwen3.5 holds the Gated DeltaNet layers' recurrent states: the estimate is a
trace of one training step on fake tensors, so every tensor the step allocates is counted, these included.

The chunked delta rule keeps for backward the state S (value heads x key_dim x value_dim, float32) that
enters each 64-token chunk, per sequence and per linear layer; the convolution keeps its input, whose
window the causal padding adds. Counted here by hand from the shapes and compared with what the traced step
saves and holds.
"""

from __future__ import annotations

import math

import pytest
import torch

from titan_models.qwen3_5 import linear_attention
from titan_models.qwen3_5.gated_delta import CHUNK
from titan_train.config import load_job_config
from titan_train.plan import resolve
from titan_train.reporting.traced_memory import trace_rank

SEQ, BATCH = 256, 2
FLAGS = [
    *("--model.name", "qwen3_5", "--model.flavor", "debugmodel"),
    *("--training.seq_len", str(SEQ), "--training.local_batch_size", str(BATCH)),
    *("--training.mixed_precision_param", "float32", "--activation_checkpoint.mode", "none"),
    *("--parallelism.data_parallel_shard_degree", "1"),
]


def _plan():
    return resolve(load_job_config(FLAGS), 1, "cpu")


def _state_bytes_by_formula(args) -> int:
    """Linear layers x chunks x batch x value heads x key_dim x value_dim x 4 bytes (float32)."""
    linear = sum(args.is_linear(i) for i in range(args.n_layers))
    heads, dk, dv = args.linear_num_value_heads, args.linear_key_head_dim, args.linear_value_head_dim
    return linear * math.ceil(SEQ / CHUNK) * BATCH * heads * dk * dv * 4


def _saving_states(saved: dict[int, int], size: int):
    """The delta rule, recording each distinct float32 storage of one state's size that autograd saves
    (matmuls save reshaped views of it, element-wise ops the tensor itself: one storage either way)."""
    rule = linear_attention.chunked_gated_delta

    def pack(t):
        storage = t.untyped_storage()
        if t.dtype == torch.float32 and storage.nbytes() == size:
            saved[storage._cdata] = size
        return t

    def recording(*args, **kwargs):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return rule(*args, **kwargs)

    return recording


def test_the_traced_step_saves_each_linear_layers_state_per_chunk(monkeypatch):
    """On fake tensors, as the dry run traces it, the step saves exactly the formula's state bytes, and the
    trace holds them at its peak: its activations exceed them. Planted: a copy of the state saved beside
    it in each chunk (`from_state @ state.clone()`) fails it."""
    plan = _plan()
    args = plan.model_args
    size = BATCH * args.linear_num_value_heads * args.linear_key_head_dim * args.linear_value_head_dim * 4
    saved: dict[int, int] = {}
    monkeypatch.setattr(linear_attention, "chunked_gated_delta", _saving_states(saved, size))
    traced = trace_rank(plan, 0)
    states = sum(saved.values())
    assert states == _state_bytes_by_formula(args) > 0
    assert traced.breakdown["activations"] > states


@pytest.mark.slow
def test_the_fake_trace_of_a_qwen3_5_step_equals_the_real_step():
    """The dry run's fake trace against the same tracker on a real CPU step of the debug flavor: peak and
    each kind (parameters, gradients, optimizer state, activations) within 64 KiB, far below the states
    the linear layers hold at seq 256 (1.5 MiB): a trace that missed them would fail."""
    plan = _plan()
    fake, real = (trace_rank(plan, 0, fake=f) for f in (True, False))
    assert _state_bytes_by_formula(plan.model_args) > 16 * 64 * 1024
    assert abs(fake.peak - real.peak) <= 64 * 1024
    assert fake.breakdown.keys() == real.breakdown.keys()
    for kind, size in real.breakdown.items():
        assert abs(fake.breakdown[kind] - size) <= 64 * 1024, (kind, fake.breakdown[kind], size)
