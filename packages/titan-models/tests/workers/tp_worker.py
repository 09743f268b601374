"""Run under torchrun (2 ranks, gloo): every family's tensor-parallel plan, and FSDP of tied embeddings,
against one process. One launch covers Llama, DeepSeek-V3, Qwen3 and Llama 4, so CI starts one world.

Uses raw torch (`parallelize_module` with the model's own `tp_plan`, `fully_shard`), builds each model
the way the trainer does (meta device, parallelise, `to_empty`, `init_weights`) and writes, per case, the
largest differences from an unsharded copy built and initialised from the same seed.
"""

import json
import sys
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from titan_models import ModelArgs, Transformer
from titan_models.deepseek_v3 import DeepSeekV3Args, DeepSeekV3Model
from titan_models.llama4 import Llama4Args, Llama4Model, llama4_moe_args
from titan_models.moe import MoEArgs
from titan_models.qwen3 import Qwen3Args, Qwen3Model, qwen3_moe_args

SEED = 11
LLAMA = ModelArgs(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=128,
    multiple_of=32,
    rope_theta=500000,
    max_seq_len=32,
    eos_id=1,
)
DEEPSEEK = DeepSeekV3Args(
    dim=64,
    n_layers=2,
    n_dense_layers=1,
    n_heads=4,
    vocab_size=128,
    inter_dim=96,
    moe_inter_dim=32,
    moe_args=MoEArgs(
        num_experts=4,
        num_shared_experts=1,
        top_k=2,
        score_func="sigmoid",
        route_norm=True,
        score_before_experts=False,
    ),
    q_lora_rank=0,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    max_seq_len=32,
    eos_id=1,
)
QWEN3_DENSE = Qwen3Args(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=32,
    vocab_size=128,
    hidden_dim=96,
    max_seq_len=32,
    eos_id=1,
)
QWEN3_MOE = replace(QWEN3_DENSE, moe_inter_dim=32, moe_args=qwen3_moe_args(4, 2))
LLAMA4_IROPE = Llama4Args(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=128,
    multiple_of=16,
    max_seq_len=32,
    moe_args=llama4_moe_args(4),
    every_n_layers_nope=2,
    attn_chunk_size=8,
    use_qk_norm=True,
    attn_temperature_tuning=True,
    floor_scale=4,
    attn_mask_type="block_causal",
    eos_id=1,
)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _reference(cls, args):
    with torch.device("meta"):
        model = cls(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=SEED)
    return model


def _batch(args) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(2, args.vocab_size, (2, args.max_seq_len + 1), generator=gen)
    tokens[:, 9] = args.eos_id  # a document boundary, for the block-causal cases
    return tokens[:, :-1], tokens[:, 1:]


def _max_diff(pairs) -> float:
    return max((_full(a).detach() - b.detach()).abs().max().item() for a, b in pairs)


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))


def _splits_heads(attention: torch.nn.Module) -> bool:
    """Whether some projection of the attention holds a shard (each rank its own heads)."""
    return any(isinstance(p, DTensor) and isinstance(p.placements[0], Shard) for p in attention.parameters())


class _ShareOfWhole(torch.autograd.Function):
    """Forward: a replicated tensor's 1/n share of a sum over n ranks; backward: the whole gradient."""

    @staticmethod
    def forward(ctx, whole: torch.Tensor, n: int) -> torch.Tensor:
        return whole / n

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _routed_output_as_partial_sum(model: torch.nn.Module, mesh) -> None:
    """The routed experts stay whole here (titan-parallel splits them, and this package cannot import it);
    where the plan declares the MoE output a partial sum over tp (`tp_output_whole` False), each rank's
    whole routed output counts as its 1/tp share, as a split expert's output would: divided in forward,
    its gradient the whole one on every rank."""
    for module in model.modules():
        if hasattr(module, "tp_output_whole") and not module.tp_output_whole:
            module.experts.register_forward_hook(lambda _m, _i, out: _ShareOfWhole.apply(out, mesh.size()))


def tp_case(cls, args, mesh, sequence_parallel: bool, loss_parallel_: bool) -> dict:
    ref = _reference(cls, args)
    with torch.device("meta"):
        model = cls(args)
    parallelize_module(
        model, mesh, model.tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel_)
    )
    _routed_output_as_partial_sum(model, mesh)
    model.to_empty(device="cpu")
    model.init_weights(seed=SEED)
    init_diff = _max_diff(zip(model.parameters(), ref.parameters(), strict=True))

    inputs, labels = _batch(args)
    ref_logits = ref(inputs)
    ref_loss = _loss(ref_logits, labels)
    ref_loss.backward()
    logits = model(inputs)
    with loss_parallel() if loss_parallel_ else torch.enable_grad():
        loss = _loss(logits, labels)
        loss.backward()
    grads = {
        name: _max_diff([(p.grad, r.grad)])
        for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True)
    }
    return {
        "init": init_diff,
        "logits": _max_diff([(logits, ref_logits)]),
        "loss": abs(_full(loss).item() - ref_loss.item()),
        "grads": max(grads.values()),
        "worst_grad": max(grads, key=grads.get),
        "sharded_params": sum(isinstance(p, DTensor) for p in model.parameters()),
        # Every parameter but the routed experts', which the plan leaves to expert parallelism (titan-parallel).
        "all_dtensor": all(
            isinstance(p, DTensor) for n, p in model.named_parameters() if ".moe.experts." not in n
        ),
        "sharded_heads": _splits_heads(model.layers["0"].attention),
        "logits_is_dtensor": isinstance(logits, DTensor),
    }


def fsdp_tied_case(args: ModelArgs, mesh) -> dict:
    """Tied embeddings under FSDP2: the tie survives sharding, and two SGD steps match one process."""
    ref = _reference(Transformer, args)
    with torch.device("meta"):
        model = Transformer(args)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    model.init_weights(seed=SEED)
    tied = model.output.weight is model.tok_embeddings.weight
    init_diff = _max_diff(zip(model.parameters(), ref.parameters(), strict=True))
    inputs, labels = _batch(args)
    losses = []
    for m in (model, ref):
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        for _ in range(2):
            opt.zero_grad()
            loss = _loss(m(inputs), labels)
            loss.backward()
            opt.step()
        losses.append(_loss(m(inputs), labels).item())
    return {
        "tied": tied and ref.output.weight is ref.tok_embeddings.weight,
        "init": init_diff,
        "loss": abs(losses[0] - losses[1]),
        "params": _max_diff(zip(model.parameters(), ref.parameters(), strict=True)),
        "n_params": sum(p.numel() for p in model.parameters()),
        "n_ref_params": sum(p.numel() for p in ref.parameters()),
    }


def main(out: str) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    ds_low_rank_yarn = replace(
        DEEPSEEK, q_lora_rank=24, yarn=True, original_seq_len=16, attn_mask_type="block_causal"
    )
    results = {
        "tp_sp_lp": tp_case(Transformer, LLAMA, mesh, True, True),
        "tp_sp": tp_case(Transformer, LLAMA, mesh, True, False),
        "tp_plain": tp_case(Transformer, LLAMA, mesh, False, False),
        "tp_block_causal": tp_case(
            Transformer, replace(LLAMA, attn_mask_type="block_causal"), mesh, True, True
        ),
        "fsdp_tied": fsdp_tied_case(replace(LLAMA, tie_word_embeddings=True), mesh),
        "deepseek_sp_lp": tp_case(DeepSeekV3Model, DEEPSEEK, mesh, True, True),
        "deepseek_low_rank_q_yarn_block_causal": tp_case(
            DeepSeekV3Model, ds_low_rank_yarn, mesh, True, False
        ),
        "deepseek_plain": tp_case(DeepSeekV3Model, DEEPSEEK, mesh, False, False),
        "qwen3_moe_sp_lp": tp_case(Qwen3Model, QWEN3_MOE, mesh, True, True),
        "qwen3_dense_plain": tp_case(Qwen3Model, QWEN3_DENSE, mesh, False, False),
        # Tied embedding and output head (Qwen3's small flavors): both shard the vocabulary, one matrix.
        "qwen3_dense_tied_sp_lp": tp_case(
            Qwen3Model, replace(QWEN3_DENSE, tie_word_embeddings=True), mesh, True, True
        ),
        "llama4_irope_sp": tp_case(Llama4Model, LLAMA4_IROPE, mesh, True, False),
        # Without sequence parallelism the MoE output (partial: split shared experts) is all-reduced.
        "llama4_irope_plain": tp_case(Llama4Model, LLAMA4_IROPE, mesh, False, False),
    }
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
