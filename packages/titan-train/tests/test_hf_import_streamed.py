"""A Hugging Face import never holds the whole model on a rank: `titan_ckpt.hf_import` hands the family's
weight mapping one transformer block of real tensors at a time (the rest are meta stand-ins), and the
model it fills computes transformers' logits on the same folder."""

from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from titan_ckpt import CheckpointError, hf_import
from titan_models import qwen3
from titan_train.registry import get_model_family
from titan_train.wiring.checkpointing import hf_adapter_for

LAYERS = 4


class _Counting:
    """The real adapter, counting the bytes of real (not meta) matrices each `from_hf` call gets."""

    def __init__(self, adapter):
        self.adapter, self.real_bytes = adapter, []

    def from_hf(self, hf):
        self.real_bytes.append(
            sum(t.numel() * t.element_size() for t in hf.values() if not t.is_meta and t.ndim > 1)
        )
        return self.adapter.from_hf(hf)


def test_an_import_reads_one_block_at_a_time_and_equals_transformers(tmp_path):
    args = replace(
        qwen3.QWEN3_FLAVORS["debugmodel_moe"],
        dim=64,
        n_layers=LAYERS,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        vocab_size=128,
        moe_inter_dim=32,
        moe_args=qwen3.qwen3_moe_args(8, 2),
        max_seq_len=32,
    )
    adapter = hf_adapter_for(get_model_family("qwen3"), args)
    reference = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(**adapter.hf_config()), dtype=torch.float32
    )
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in reference.parameters():
            t.copy_(torch.randn(t.shape, generator=g) * 0.2)
    reference.save_pretrained(tmp_path, max_shard_size="100KB")  # several files, blocks across them

    model = qwen3.Qwen3Model(args)
    counting = _Counting(adapter)
    hf_import.load_hf_weights(tmp_path, counting, model.state_dict())

    sizes = {n: p.numel() * p.element_size() for n, p in reference.state_dict().items() if p.ndim > 1}
    block = [sum(v for n, v in sizes.items() if f".layers.{i}." in n) for i in range(LAYERS)]
    rest = sum(sizes.values()) - sum(block)
    # One call for the embeddings and head, one per block; no call sees more than one block's tensors.
    assert sorted(counting.real_bytes) == sorted([rest, *block])
    assert max(counting.real_bytes) < sum(sizes.values()) / 2

    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens).logits, atol=1e-5, rtol=1e-5)


def test_a_truncated_shard_is_refused_before_any_weight_is_read(tmp_path):
    args = replace(
        qwen3.QWEN3_FLAVORS["debugmodel"], n_layers=1, dim=64, n_heads=4, n_kv_heads=2, head_dim=16
    )
    adapter = hf_adapter_for(get_model_family("qwen3"), args)
    model = qwen3.Qwen3Model(args)
    save_file(
        {k: v.contiguous() for k, v in adapter.to_hf(model.state_dict()).items()}, tmp_path / "m.safetensors"
    )
    data = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "m.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=r"m\.safetensors \(.*bytes where the header needs.*truncated"):
        hf_import.load_hf_weights(tmp_path, adapter, model.state_dict())
