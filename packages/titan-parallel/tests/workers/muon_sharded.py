"""Run by test_muon_sharded.py under torchrun (2 ranks, gloo): titan_parallel.Muon on DTensors split every
way a layout splits a matrix, against torch.optim.Muon on the whole tensors in this process."""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from titan_parallel import Muon

SETTINGS = {
    "lr": 0.02,
    "weight_decay": 0.1,
    "momentum": 0.95,
    "nesterov": True,
    "ns_coefficients": (3.4445, -4.775, 2.0315),
    "ns_steps": 5,
    "eps": 1e-7,
    "adjust_lr_fn": "original",
}
# name: (shape, placement): FSDP's and colwise TP's rows, rowwise TP's columns, experts split by expert
# (expert parallelism: whole matrices on each rank) or inside each matrix (expert tensor parallelism).
CASES = {
    "rows": ([64, 32], Shard(0)),
    "columns": ([48, 64], Shard(1)),
    "replicated": ([16, 24], Replicate()),
    "experts_by_expert": ([4, 16, 8], Shard(0)),
    "experts_split": ([4, 16, 8], Shard(1)),
    # FSDP's rows of a tensor-parallel shard: every other row on a rank.
    "strided_rows": ([32, 16], _StridedShard(0, split_factor=2)),
}
# One group of split matrices of several sizes: shared out between the ranks, each orthogonalising some.
SEVERAL = [
    ([64, 32], Shard(0)),
    ([48, 64], Shard(1)),
    ([32, 16], Shard(0)),
    ([16, 48], Shard(1)),
    ([8, 8], Shard(0)),
]


def main(out: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    generator = torch.Generator().manual_seed(0)
    results = {}
    for name, (shape, placement) in CASES.items():
        start = torch.randn(shape, generator=generator)
        grads = [torch.randn(shape, generator=generator) for _ in range(3)]
        param = torch.nn.Parameter(distribute_tensor(start.clone(), mesh, [placement]))
        ours = Muon([{"params": [param], "muon": True, "stacked": len(shape) - 2, **SETTINGS}])
        whole = torch.nn.Parameter(start.clone())
        matrices = [whole.detach()[e] for e in range(shape[0])] if len(shape) == 3 else [whole]
        kwargs = {k: v for k, v in SETTINGS.items() if k != "lr"}
        reference = torch.optim.Muon(matrices, lr=SETTINGS["lr"], **kwargs)
        for g in grads:
            param.grad = distribute_tensor(g.clone(), mesh, [placement])
            for i, m in enumerate(matrices):
                m.grad = g[i].clone() if len(shape) == 3 else g.clone()
            ours.step()
            reference.step()
        got = param.full_tensor()
        results[name] = {
            "difference": (got - whole.detach()).abs().max().item(),
            "moved": (whole.detach() - start).abs().max().item(),
            "gathered_bytes": ours.timing.gathered_bytes,
            "momentum_local_shape": list(ours.state[param]["momentum_buffer"].to_local().shape),
        }
    results["several"] = several(mesh, generator)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def several(mesh, generator) -> dict:
    """SEVERAL in one group against torch.optim.Muon on the whole tensors; how many each rank orthogonalised."""
    starts = [torch.randn(shape, generator=generator) for shape, _ in SEVERAL]
    params = [
        torch.nn.Parameter(distribute_tensor(s.clone(), mesh, [placement]))
        for s, (_, placement) in zip(starts, SEVERAL, strict=True)
    ]
    wholes = [torch.nn.Parameter(s.clone()) for s in starts]
    ours = Muon([{"params": params, "muon": True, "stacked": 0, **SETTINGS}])
    kwargs = {k: v for k, v in SETTINGS.items() if k != "lr"}
    reference = torch.optim.Muon(wholes, lr=SETTINGS["lr"], **kwargs)
    for _ in range(3):
        for param, whole, (shape, placement) in zip(params, wholes, SEVERAL, strict=True):
            g = torch.randn(shape, generator=generator)
            param.grad = distribute_tensor(g.clone(), mesh, [placement])
            whole.grad = g
        ours.step()
        reference.step()
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, ours.timing.matrices)
    return {
        "difference": max(
            (p.full_tensor() - w.detach()).abs().max().item() for p, w in zip(params, wholes, strict=True)
        ),
        "moved": min((w.detach() - s).abs().max().item() for w, s in zip(wholes, starts, strict=True)),
        "gathered_bytes": ours.timing.gathered_bytes,
        "matrices_per_rank": per_rank,
        "momentum_local_shape": list(ours.state[params[0]]["momentum_buffer"].to_local().shape),
    }


if __name__ == "__main__":
    main(sys.argv[1])
