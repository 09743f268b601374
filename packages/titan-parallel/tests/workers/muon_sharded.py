"""Run by test_muon_sharded.py under torchrun (2 ranks, gloo): titan_parallel.Muon on DTensors split every
way a layout splits a matrix, against torch.optim.Muon on the whole tensors in this process."""

import json
import sys

import torch
import torch.distributed as dist
from clean_exit import exit_now
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from titan_parallel import Muon, clip_query_key

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
}
# FSDP's rows of a tensor-parallel shard: every other row on a rank. Alone on a one-dimensional mesh, torch 2.11
# cannot redistribute it ("unable to be interpreted into a corresponding shard_order"): claimed for >= 2.15.
STRIDED_ALONE = tuple(int(n) for n in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 15)
if STRIDED_ALONE:
    CASES["strided_rows"] = ([32, 16], _StridedShard(0, split_factor=2))
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
    results["qk_clip"] = qk_clip(mesh, generator)
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


HEADS, KV_HEADS, HEAD_DIM, DIM = 4, 2, 4, 16


class Attention:
    """The attention's side of HasQueryKeyHeads: its FSDP-split wq, wk and this rank's largest logit per head."""

    def __init__(self, wq, wk, logits):
        self.heads = {"attention": (wq, wk, logits)}

    def query_key_heads(self):
        return self.heads


def peaks(wq: torch.Tensor, wk: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Each query head's largest q . k / sqrt(head_dim) over the tokens of x, from whole weights."""
    q = (x @ wq.T).view(-1, HEADS, HEAD_DIM).transpose(0, 1)
    k = (x @ wk.T).view(-1, KV_HEADS, HEAD_DIM).transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, dim=0)
    return (q @ k.transpose(1, 2) / HEAD_DIM**0.5).amax(dim=(1, 2))


def qk_clip(mesh, generator) -> dict:
    """QK-clip over 2 FSDP ranks that saw different tokens (rank 1's 3x larger, so most heads peak there),
    grouped-query attention (2 query heads a key head): recomputed from the whole clipped weights over both
    ranks' tokens, each head above tau peaks at tau and the others keep their peak."""
    wq, wk = (
        torch.randn(HEADS * HEAD_DIM, DIM, generator=generator),
        torch.randn(KV_HEADS * HEAD_DIM, DIM, generator=generator),
    )
    wq[HEAD_DIM : 2 * HEAD_DIM] *= 4.0  # a planted large query head 1 (key head 0)
    xs = [torch.randn(8, DIM, generator=generator) * scale for scale in (1.0, 3.0)]
    before = torch.stack([peaks(wq, wk, x) for x in xs]).amax(dim=0)
    tau = before.sort().values[1:3].mean().item()  # two heads above it, two under
    q, k = (torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)])) for w in (wq, wk))
    own = peaks(wq, wk, xs[dist.get_rank()])
    clipped = clip_query_key(Attention(q, k, own.clone()), tau, dist.group.WORLD)
    after = torch.stack([peaks(q.full_tensor(), k.full_tensor(), x) for x in xs]).amax(dim=0)
    expected = torch.where(before > tau, torch.full_like(before, tau), before)
    return {
        "difference": ((after - expected).abs() / expected).max().item(),
        "above_tau": int((before > tau).sum()),
        "peaks_only_on_rank_1": int((peaks(wq, wk, xs[1]) > peaks(wq, wk, xs[0])).sum()),
        "clipped_heads": sorted(h for _, h, _ in clipped),
    }


if __name__ == "__main__":
    main(sys.argv[1])
    exit_now()  # see clean_exit
