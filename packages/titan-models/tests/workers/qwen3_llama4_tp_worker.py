"""Run under torchrun (2 ranks, gloo): the Qwen3 and Llama 4 tensor-parallel plans against one process.

Builds each model as the trainer does (meta device, `parallelize_module` with the model's `tp_plan`,
`to_empty`, `init_weights`) and writes, per case, the largest differences from an unsharded copy built
from the same seed: initial weights, logits, loss and every gradient.
"""

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from titan_models.llama4 import Llama4Args, Llama4Model, llama4_moe_args
from titan_models.qwen3 import Qwen3Args, Qwen3Model, qwen3_moe_args

SEED = 7
QWEN3_MOE = Qwen3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=128, hidden_dim=96,
                      max_seq_len=32, moe_inter_dim=32, moe_args=qwen3_moe_args(4, 2))  # fmt: skip
QWEN3_DENSE = Qwen3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=128, hidden_dim=96,
                        max_seq_len=32)  # fmt: skip
LLAMA4_IROPE = Llama4Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=16, max_seq_len=32,
                          moe_args=llama4_moe_args(4), every_n_layers_nope=2, attn_chunk_size=8, use_qk_norm=True,
                          attn_temperature_tuning=True, floor_scale=4, attn_mask_type="block_causal", eos_id=1)  # fmt: skip


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _max_diff(pairs) -> float:
    return max((_full(a).detach() - b.detach()).abs().max().item() for a, b in pairs)


def tp_case(cls, args, mesh, sequence_parallel: bool, loss_parallel_: bool) -> dict:
    ref = cls(args)
    ref.init_weights(seed=SEED)
    with torch.device("meta"):
        model = cls(args)
    parallelize_module(
        model, mesh, model.tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel_)
    )
    model.to_empty(device="cpu")
    model.init_weights(seed=SEED)
    init_diff = _max_diff(zip(model.parameters(), ref.parameters(), strict=True))
    tokens = torch.randint(2, args.vocab_size, (2, 33), generator=torch.Generator().manual_seed(5))
    tokens[:, 9] = 1
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    ref_logits = ref(inputs)
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten())
    ref_loss.backward()
    logits = model(inputs)
    with loss_parallel() if loss_parallel_ else torch.enable_grad():
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
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
        "sharded_heads": isinstance(model.layers["0"].attention.wq.weight, DTensor),
    }


def main(out: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = {
        "qwen3_moe_sp_lp": tp_case(Qwen3Model, QWEN3_MOE, mesh, True, True),
        "qwen3_dense_plain": tp_case(Qwen3Model, QWEN3_DENSE, mesh, False, False),
        "llama4_irope_sp": tp_case(Llama4Model, LLAMA4_IROPE, mesh, True, False),
    }
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
