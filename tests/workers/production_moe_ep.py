"""Worker of tests/test_production_moe_expert_parallel.py: titan_models' MoE layer under titan_parallel's
expert parallelism (ep 2 on 2 gloo ranks) against the same layer unsharded on the whole batch.

Each routing (DeepSeek's: scores after the experts, sigmoid, renormalised, grouped; Llama 4's: top 1 scaling
the token before its expert) gets random weights and a random expert bias; every rank computes the
unsharded layer on the whole batch and the expert-parallel copy on its half. Writes, per routing, the largest
differences of the outputs, the input gradients, the router's and shared experts' gradients (summed over
ranks), the rank's experts' gradients, the token counts summed over ranks, and how many experts it holds.
"""

import copy
import json
import sys

import torch
import torch.distributed as dist

from titan_models.moe import MoE, MoEArgs
from titan_parallel import ParallelDims
from titan_parallel.expert_parallel import apply_expert_parallel

DIM, HIDDEN, EXPERTS = 32, 16, 4
ROUTINGS = {
    "deepseek": MoEArgs(
        num_experts=EXPERTS,
        num_shared_experts=1,
        score_func="sigmoid",
        route_norm=True,
        route_scale=2.5,
        score_before_experts=False,
        top_k=2,
        num_expert_groups=2,
        num_limited_groups=1,
        use_grouped_mm=False,
    ),
    "llama4": MoEArgs(num_experts=EXPERTS, num_shared_experts=1, top_k=1, use_grouped_mm=False),
}


class OneLayer(torch.nn.Module):
    """The MoE layer as a model declares its MoE layers to titan-parallel (`HasMoELayers`)."""

    def __init__(self, moe: MoE):
        super().__init__()
        self.moe = moe

    def moe_layers(self) -> dict[str, MoE]:
        return {"moe": self.moe}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)


def _randomised(args: MoEArgs, seed: int) -> OneLayer:
    torch.manual_seed(seed)
    moe = MoE(args, DIM, HIDDEN)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
        moe.expert_bias.normal_(0, 0.05)
    return OneLayer(moe)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def compare(args: MoEArgs, dims: ParallelDims, rank: int) -> dict[str, float]:
    reference = _randomised(args, seed=0)
    sharded = copy.deepcopy(reference)
    apply_expert_parallel(sharded, dims)
    g = torch.Generator().manual_seed(1)
    x, weight = torch.randn(2, 24, DIM, generator=g), torch.randn(2, 24, DIM, generator=g)
    x_all = x.clone().requires_grad_()
    out_all = reference(x_all)
    (out_all * weight).sum().backward()
    x_mine = x[rank : rank + 1].clone().requires_grad_()
    out = sharded(x_mine)
    (out * weight[rank : rank + 1]).sum().backward()
    diffs = {
        "output": (out - out_all[rank : rank + 1]).abs().max().item(),
        "input grad": (x_mine.grad - x_all.grad[rank : rank + 1]).abs().max().item(),
    }
    ref_params = dict(reference.named_parameters())
    per_rank = EXPERTS // dims.ep
    for name, p in sharded.named_parameters():
        grad = _local(p.grad)
        want = ref_params[name].grad
        if name.startswith("moe.experts."):
            want = want[rank * per_rank : (rank + 1) * per_rank]
        else:  # replicated over the data ranks: each holds its tokens' share
            grad = grad.clone()
            dist.all_reduce(grad)
        diffs[f"grad {name}"] = (grad - want).abs().max().item()
    counts = sharded.moe.tokens_per_expert.clone()
    dist.all_reduce(counts)
    diffs["tokens per expert"] = (counts - reference.moe.tokens_per_expert).abs().max().item()
    diffs["scale"] = out.abs().max().item()  # not a comparison of near-zero outputs
    diffs["local experts"] = _local(sharded.moe.experts.w1).shape[0]  # the experts really are split
    return diffs


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dims = ParallelDims(dp_shard=2, ep=2, world_size=2)
    dims.build_mesh("cpu")
    results = {name: compare(args, dims, rank) for name, args in ROUTINGS.items()}
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
