"""Run under torchrun (2 ranks, gloo): tensor-parallel and FSDP layouts of a tiny Llama against one process.

Uses raw torch (`parallelize_module` with the model's own `tp_plan`, `fully_shard`), builds the model
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
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from titan_models import ModelArgs, Transformer

SEED = 11
ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32,
                 rope_theta=500000, max_seq_len=32, eos_id=1)  # fmt: skip


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _reference(args: ModelArgs) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=SEED)
    return model


def _batch(args: ModelArgs) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(2, args.vocab_size, (2, args.max_seq_len + 1), generator=gen)
    tokens[:, 9] = args.eos_id  # a document boundary, for the block-causal case
    return tokens[:, :-1], tokens[:, 1:]


def _max_diff(pairs) -> float:
    return max((_full(a).detach() - b.detach()).abs().max().item() for a, b in pairs)


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))


def tp_case(args: ModelArgs, mesh, sequence_parallel: bool, loss_parallel_: bool) -> dict:
    ref = _reference(args)
    with torch.device("meta"):
        model = Transformer(args)
    parallelize_module(
        model, mesh, model.tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel_)
    )
    model.to_empty(device="cpu")
    model.init_weights(seed=SEED)
    init_diff = _max_diff(zip(model.parameters(), ref.parameters(), strict=True))
    sharded = sum(isinstance(p, DTensor) for p in model.parameters())

    inputs, labels = _batch(args)
    ref_logits = ref(inputs)
    _loss(ref_logits, labels).backward()
    logits = model(inputs)
    if loss_parallel_:
        with loss_parallel():
            loss = _loss(logits, labels)
            loss.backward()
    else:
        loss = _loss(logits, labels)
        loss.backward()
    return {
        "init": init_diff,
        "logits": _max_diff([(logits, ref_logits)]),
        "loss": abs(_full(loss).item() - _loss(ref_logits, labels).item()),
        "grads": _max_diff(
            (p.grad, r.grad) for p, r in zip(model.parameters(), ref.parameters(), strict=True)
        ),
        "sharded_params": sharded,
        "logits_is_dtensor": isinstance(logits, DTensor),
    }


def fsdp_tied_case(args: ModelArgs, mesh) -> dict:
    """Tied embeddings under FSDP2: the tie survives sharding, and two SGD steps match one process."""
    ref = _reference(args)
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
    results = {
        "tp_sp_lp": tp_case(ARGS, mesh, True, True),
        "tp_sp": tp_case(ARGS, mesh, True, False),
        "tp_plain": tp_case(ARGS, mesh, False, False),
        "tp_block_causal": tp_case(replace(ARGS, attn_mask_type="block_causal"), mesh, True, True),
        "fsdp_tied": fsdp_tied_case(replace(ARGS, tie_word_embeddings=True), mesh),
    }
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
