"""Run under torchrun (2 ranks, gloo): DeepSeek-V3's tensor-parallel plan against one process.

Builds the model as the trainer does (meta device, `parallelize_module` with the model's `tp_plan`,
`to_empty`, `init_weights`) and writes, per case, the largest differences from an unsharded copy built
from the same seed: initial weights, logits, loss and every gradient.
"""

import json
import sys
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from titan_models.deepseek_v3 import DeepSeekV3Args, DeepSeekV3Model
from titan_models.moe import MoEArgs

SEED = 7
ARGS = DeepSeekV3Args(
    dim=64, n_layers=2, n_dense_layers=1, n_heads=4, vocab_size=128, inter_dim=96, moe_inter_dim=32,
    moe_args=MoEArgs(num_experts=4, num_shared_experts=1, top_k=2, score_func="sigmoid", route_norm=True,
                     score_before_experts=False),
    q_lora_rank=0, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
    max_seq_len=32, eos_id=1,
)  # fmt: skip


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _max_diff(pairs) -> float:
    return max((_full(a).detach() - b.detach()).abs().max().item() for a, b in pairs)


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))


def tp_case(args: DeepSeekV3Args, mesh, sequence_parallel: bool, loss_parallel_: bool) -> dict:
    ref = DeepSeekV3Model(args)
    ref.init_weights(seed=SEED)
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    parallelize_module(
        model, mesh, model.tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel_)
    )
    model.to_empty(device="cpu")
    model.init_weights(seed=SEED)
    init_diff = _max_diff(zip(model.parameters(), ref.parameters(), strict=True))
    tokens = torch.randint(
        2, args.vocab_size, (2, args.max_seq_len + 1), generator=torch.Generator().manual_seed(5)
    )
    tokens[:, 9] = args.eos_id
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
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
        "sharded_heads": isinstance(model.layers["0"].attention.wkv_b.weight, DTensor),
        # Every parameter but the routed experts', which the plan leaves to expert parallelism (titan-parallel).
        "all_dtensor": all(
            isinstance(p, DTensor) for n, p in model.named_parameters() if ".moe.experts." not in n
        ),
    }


def main(out: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = {
        "sp_lp": tp_case(ARGS, mesh, True, True),
        "low_rank_q_yarn_block_causal": tp_case(
            replace(ARGS, q_lora_rank=24, yarn=True, original_seq_len=16, attn_mask_type="block_causal"),
            mesh, True, False,
        ),
        "plain": tp_case(ARGS, mesh, False, False),
    }  # fmt: skip
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
