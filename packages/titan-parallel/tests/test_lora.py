"""LoRA adapters against a direct implementation written here: out = base(x) + (alpha / rank) * B(A(dropout(x))),
with the base frozen, the chosen layers adapted, and the adapters' initial values as PEFT draws them."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from titan_parallel import LoRA, ParallelConfigError, apply_lora, init_lora


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(16, 24, bias=False)
        self.wv = nn.Linear(16, 24, bias=True)
        self.w2 = nn.Linear(24, 16, bias=False)
        self.gate = nn.Linear(16, 4, bias=False)  # an MoE router: never adapted by all-linear
        self.output = nn.Linear(16, 32, bias=False)
        self.tok_embeddings = nn.Embedding(32, 16)

    def linears_not_adapted(self):
        return ("output", "gate")

    def forward(self, x):
        h = self.w2(torch.relu(self.wq(x) + self.wv(x)))
        return self.output(h + x) + self.gate(x).sum(-1, keepdim=True)


def _reference(model: Block, x, lora: LoRA, adapters: dict) -> torch.Tensor:
    """The same block with each adapted linear computed from its weights by hand, dropout in hook order."""

    def linear(name, inp):
        layer = getattr(model, name)
        out = F.linear(inp, layer.weight, layer.bias)
        if name in adapters:
            a, b = adapters[name]
            dropped = F.dropout(inp, lora.dropout, training=True) if lora.dropout else inp
            out = out + (lora.alpha / lora.rank) * (dropped @ a.T) @ b.T
        return out

    h = linear("w2", torch.relu(linear("wq", x) + linear("wv", x)))
    return linear("output", h + x) + linear("gate", x).sum(-1, keepdim=True)


@pytest.mark.parametrize(
    "lora",
    [
        LoRA(rank=4, alpha=8.0, targets=("wq", "wv")),
        LoRA(
            rank=3, alpha=1.5, dropout=0.25, targets=("all-linear",), trainable=("tok_embeddings", "output")
        ),
    ],
)
def test_adapted_block_equals_a_direct_implementation_and_only_adapters_take_gradients(lora):
    torch.manual_seed(0)
    model = Block()
    apply_lora(model, lora)
    init_lora(model, seed=3)
    adapted = {n for n, m in model.named_modules() if hasattr(m, "lora_A")}
    expected = {"wq", "wv"} if lora.targets == ("wq", "wv") else {"wq", "wv", "w2"}
    assert adapted == expected
    adapters = {}
    for name in adapted:
        layer = getattr(model, name)
        assert layer.lora_A.weight.shape == (lora.rank, layer.in_features)
        assert layer.lora_B.weight.shape == (layer.out_features, lora.rank)
        assert torch.equal(layer.lora_B.weight, torch.zeros_like(layer.lora_B.weight))  # B starts at zero
        bound = 1 / math.sqrt(layer.in_features)  # kaiming_uniform_(a=sqrt(5)), as nn.Linear and PEFT
        assert layer.lora_A.weight.abs().max() <= bound and layer.lora_A.weight.std() > bound / 3
        with torch.no_grad():
            layer.lora_B.weight.normal_()  # random B, so the adapter's path shows in the output
        adapters[name] = (layer.lora_A.weight, layer.lora_B.weight)
    x = torch.randn(2, 5, 16)
    torch.manual_seed(7)
    ours = model(x)
    torch.manual_seed(7)
    reference = _reference(model, x, lora, adapters)
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-6)
    ours.square().mean().backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    trained_in_full = {f"{m}.weight" for m in lora.trainable} - {"tok_embeddings.weight"}  # unused in forward
    assert with_grad == {f"{n}.lora_{ab}.weight" for n in adapted for ab in "AB"} | trained_in_full
    assert {n for n, p in model.named_parameters() if p.requires_grad} == (
        {f"{n}.lora_{ab}.weight" for n in adapted for ab in "AB"} | {f"{m}.weight" for m in lora.trainable}
    )


def test_initial_adapters_depend_on_name_and_seed_only():
    first, second = Block(), Block()
    for model in (first, second):
        apply_lora(model, LoRA(targets=("wq", "wv")))
    init_lora(first, seed=1)
    init_lora(second, seed=1)
    assert torch.equal(first.wq.lora_A.weight, second.wq.lora_A.weight)
    assert not torch.equal(first.wq.lora_A.weight, first.wv.lora_A.weight[:, :16])
    init_lora(second, seed=2)
    assert not torch.equal(first.wq.lora_A.weight, second.wq.lora_A.weight)


@pytest.mark.parametrize(
    "kwargs,says",
    [
        ({"rank": 0}, "lora: rank must be a positive integer, got 0"),
        ({"alpha": 0.0}, "lora: alpha must be above 0, got 0.0"),
        ({"dropout": 1.0}, "lora: dropout must be in [0, 1), got 1.0"),
        ({"dropout": -0.1}, "lora: dropout must be in [0, 1), got -0.1"),
    ],
)
def test_bad_settings_are_refused(kwargs, says):
    with pytest.raises(ParallelConfigError) as err:
        LoRA(**kwargs)
    assert str(err.value) == says


def test_a_target_naming_no_linear_is_refused_listing_those_that_exist():
    with pytest.raises(ParallelConfigError) as err:
        apply_lora(Block(), LoRA(targets=("wq", "wk")))
    assert str(err.value) == (
        "lora: target_modules ['wk'] match no linear layer of Block; its linear layers are "
        "['gate', 'output', 'w2', 'wq', 'wv'] (or use all-linear)"
    )


class Wide(nn.Module):
    """Two linears big enough for NF4's blocks (64 values, scales in blocks of 256)."""

    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(256, 256, bias=False)
        self.w2 = nn.Linear(256, 512, bias=False)

    def forward(self, x):
        return self.w2(torch.relu(self.wq(x)))


def test_qlora_stores_the_base_in_nf4_at_half_a_byte_and_trains_only_the_adapters():
    from titan_parallel import quantize_base_to_nf4, stored_bytes
    from titan_parallel.qlora import nf4_quantizer

    to_nf4 = nf4_quantizer()

    torch.manual_seed(0)
    model = Wide()
    dense = {n: m.weight.detach().clone() for n, m in model.named_children()}
    lora = LoRA(rank=4, alpha=8.0, targets=("all-linear",))
    apply_lora(model, lora)
    init_lora(model, seed=0)
    with torch.no_grad():  # B starts at zero: give it values so the adapters count in the output
        for m in (model.wq, model.w2):
            m.lora_B.weight.normal_(0, 0.1)
    assert quantize_base_to_nf4(model, scaler_block_size=256) == 2
    params = sum(w.numel() for w in dense.values())
    per_param = sum(stored_bytes(m.weight) for m in (model.wq, model.w2)) / params
    assert 0.5 <= per_param <= 0.53, per_param  # 4 bits + an 8-bit scale per 64 + a float32 per 256 scales

    # Against a direct computation on torchao's own dequantisation of the same weights.
    x = torch.randn(3, 256)
    deq = {n: to_nf4(w, 64, 256).get_original_weight() for n, w in dense.items()}
    assert (deq["wq"] - dense["wq"]).abs().max() > 0  # NF4 is lossy: the test would see a dense base

    def reference(inp):
        def adapted(name, v):
            m = getattr(model, name)
            return v @ deq[name].T + lora.scale * (v @ m.lora_A.weight.T) @ m.lora_B.weight.T

        return adapted("w2", torch.relu(adapted("wq", inp)))

    out = model(x)
    torch.testing.assert_close(out, reference(x), rtol=1e-5, atol=1e-5)

    # One AdamW step: the adapters move, the NF4 base has no gradient and keeps every code.
    codes = model.wq.weight.quantized_data.clone()
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(trainable) == 4 and all(p.dtype == torch.float32 for p in trainable)
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    out.square().mean().backward()
    assert model.wq.weight.grad is None and all(p.grad is not None for p in trainable)
    before = [p.detach().clone() for p in trainable]
    optimizer.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, trainable, strict=True))
    assert torch.equal(model.wq.weight.quantized_data, codes)


def test_qlora_refuses_a_weight_nf4_blocks_do_not_divide():
    from titan_parallel import quantize_base_to_nf4

    model = Block()
    apply_lora(model, LoRA(rank=2, targets=("wq",)))
    with pytest.raises(ParallelConfigError, match=r"qlora: wq.weight has 384 values, not a multiple of 64 x"):
        quantize_base_to_nf4(model, scaler_block_size=256)
