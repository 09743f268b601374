"""A model family added with one registration and no edit elsewhere: a tiny dense-plus-MoE decoder
defined in this file trains through `titan-train`, exports its weights through its own Hugging Face
mapping, loads back from that export, and generates through the KV cache.

What the family brings is all on the family: its attention (biased query/key/value projections, not
Titan's `Attention`) names its KV-cache hook (`kv_cache`), its blocks are the shared `DecoderBlock`
given a SwiGLU or a mixture of experts, its initialisation rules name its biases, and its mapping is an
object with `to_hf`, `from_hf` and `hf_config`. The checks compare with independent references: the
exported tensors with the trained model's own under the mapping's names, the cached logits with the
full forward's, and greedy generation through the cache with generation that recomputes every position.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import titan_models
from titan_models.args import ModelArgs
from titan_models.attention import attend, attention_tail
from titan_models.cached_attention import HeadsCache
from titan_models.decoder import Decoder
from titan_models.decoder_block import DecoderBlock
from titan_models.feed_forward import FeedForward
from titan_models.generation import SamplingParams, generate, has_kv_cache
from titan_models.init import INPUT_PROJECTIONS
from titan_models.kv_cache import KVCache, forward_cached
from titan_models.moe import MoE, MoEArgs
from titan_models.rope import apply_rotary
from titan_models.tensor_parallel_plan import gqa_tp_entries
from titan_parallel import plain_name
from titan_train import registry
from titan_train.cli import run
from titan_train.commands.checkpoint_model import load_checkpoint_model
from titan_train.config import load_job_config
from titan_train.model_family import HFMapping, ModelFamily
from titan_train.registry import register_model_family

NAME = "tiny_mix"


@dataclass
class MixArgs(ModelArgs):
    """Llama's shape, with every block from `n_dense_layers` on a mixture of experts."""

    n_dense_layers: int = 1
    moe_args: MoEArgs = field(default_factory=lambda: MoEArgs(num_experts=4, top_k=2, num_shared_experts=1))
    moe_hidden_dim: int = 64


class BiasedAttention(nn.Module):
    """Grouped-query attention whose query, key and value projections carry biases."""

    kv_cache = HeadsCache()

    def __init__(self, args: MixArgs):
        super().__init__()
        self.backend, self.head_dim = args.attn_backend, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=True)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=True)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=True)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def project(self, x, freqs_cis, positions=None):
        bs, seq_len, _ = x.shape
        xq = self.wq(x).view(bs, seq_len, -1, self.head_dim)
        xk = self.wk(x).view(bs, seq_len, -1, self.head_dim)
        xv = self.wv(x).view(bs, seq_len, -1, self.head_dim)
        xq, xk = apply_rotary(xq, xk, freqs_cis)
        return xq, xk, xv

    def forward(self, x, freqs_cis, mask):
        xq, xk, xv = self.project(x, freqs_cis)
        return attention_tail(self.wo, xq, xk, xv, attend, self.backend, mask)


class MixModel(Decoder):
    """Dense blocks first, then MoE blocks, on the shared frame."""

    input_projections = (*INPUT_PROJECTIONS, "wq.bias", "wk.bias", "wv.bias")

    def build_block(self, layer: int) -> nn.Module:
        a = self.args
        moe = layer >= a.n_dense_layers
        return DecoderBlock(
            BiasedAttention(a),
            dim=a.dim,
            norm_eps=a.norm_eps,
            moe=MoE(a.moe_args, dim=a.dim, hidden_dim=a.moe_hidden_dim) if moe else None,
            feed_forward=None if moe else FeedForward(a.dim, a.ffn_hidden_dim),
        )

    def attention_tp_entries(self):
        return gqa_tp_entries()


class MixHFAdapter:
    """The family's own published layout: every tensor under `model.`, the shape in config.json."""

    def __init__(self, args: MixArgs, *, bos_id: int | None = None, eos_id: int | None = None):
        self.args = args

    def to_hf(self, state_dict):
        return {f"model.{plain_name(k)}": v for k, v in state_dict.items()}

    def from_hf(self, hf_state_dict):
        return {k.removeprefix("model."): v for k, v in hf_state_dict.items()}

    def hf_config(self) -> dict:
        return {"model_type": NAME, "hidden_size": self.args.dim, "num_hidden_layers": self.args.n_layers}


def _differences(args: MixArgs, config: dict) -> list[str]:
    ours = MixHFAdapter(args).hf_config()
    return [f"{k}: {config.get(k)} != {v}" for k, v in ours.items() if config.get(k) != v]


def _args_from_config(config: dict, **overrides) -> MixArgs:
    return replace(TINY, dim=config["hidden_size"], n_layers=config["num_hidden_layers"], **overrides)


TINY = MixArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=2048, multiple_of=32, max_seq_len=64)
FAMILY = ModelFamily(
    NAME,
    {"tiny": TINY},
    MixModel,
    titan_models.flops_per_token,
    hf=HFMapping(MixHFAdapter, _args_from_config, _differences),
)
FLAGS = (
    *("--model.name", NAME, "--model.flavor", "tiny", "--training.seq_len", "32"),
    *("--training.steps", "3", "--optimizer.lr", "1e-2", "--lr_scheduler.warmup_steps", "2"),
    *("--activation_checkpoint.mode", "none", "--metrics.log_freq", "1"),
    *("--checkpoint.enable", "--checkpoint.last_save_in_hf"),
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Iterator[Path]:
    """The dump folder of a 3-step run of the new family, exported in its Hugging Face layout."""
    # The one registration: nothing outside this file names the family. Made on a copy of the registry
    # that the module's tests use, so that tests sharing this process see the registry as it ships.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(registry, "_FAMILIES", dict(registry._FAMILIES))
        register_model_family(FAMILY)
        dump = tmp_path_factory.mktemp("tiny_mix")
        assert run(["--job.dump_folder", str(dump), *FLAGS]) == 0
        yield dump


def _loaded(dump: Path, weights: str) -> nn.Module:
    config = load_job_config(["--job.dump_folder", str(dump), *FLAGS])
    return load_checkpoint_model(config, dump / "checkpoint" / "step-3", weights=weights, device="cpu").model


def test_a_family_registered_in_a_test_trains_and_exports_through_its_own_mapping(trained):
    lines = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]
    folder = trained / "checkpoint" / "step-3"
    assert json.loads((folder / "config.json").read_text())["model_type"] == NAME
    exported = {k: v for f in folder.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    trained_model = _loaded(trained, "dcp")
    # Every weight, the dense block's and the experts' (and the expert bias balancing moved), under
    # the family's names with the trained values.
    ours = {f"model.{k}": v for k, v in trained_model.state_dict().items()}
    assert exported.keys() == ours.keys()
    assert {"model.layers.0.feed_forward.w1.weight", "model.layers.2.moe.experts.w1"} <= exported.keys()
    assert all(torch.equal(exported[k], ours[k]) for k in ours)
    initial = MixModel(TINY)
    initial.init_weights(seed=0)
    assert not torch.equal(initial.layers["2"].moe.experts.w1, trained_model.layers["2"].moe.experts.w1)


def test_a_family_registered_in_a_test_generates_through_its_kv_cache(trained):
    model = _loaded(trained, "hf")
    assert has_kv_cache(model)
    tokens = torch.randint(0, TINY.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    cache = KVCache.for_model(model, batch=2, max_len=24)
    prefill = forward_cached(model, tokens[:, :16], cache)
    steps = [forward_cached(model, tokens[:, i : i + 1], cache) for i in range(16, 20)]
    with torch.no_grad():
        full = model(tokens)
    torch.testing.assert_close(prefill, full[:, 15], atol=1e-5, rtol=1e-5)
    for i, logits in enumerate(steps):
        torch.testing.assert_close(logits, full[:, 16 + i], atol=1e-5, rtol=1e-5)
    prompts = [[5, 17, 99, 4, 250], [7, 8]]
    params = SamplingParams(max_new_tokens=6)
    cached = generate(model, prompts, params)
    assert cached.tokens == generate(model, prompts, params, kv_cache=False).tokens
