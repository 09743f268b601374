"""A small mixture-of-experts decoder written with torch.nn only, laid out as `HasMoELayers` describes.

Blocks alternate: even ones have a dense SwiGLU, odd ones an MoE layer (top-2 router with an
expert bias, 4 stacked experts run one by one, a shared expert), so dense and expert parameters
live side by side as in DeepSeek-V3 or Llama 4.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInputOutput, RowwiseParallel
from toy_transformer import DIM, HEADS, Attention, FeedForward, ToyTransformer

EXPERTS, TOP_K, EXPERT_HIDDEN = 4, 2, 32


class Experts(nn.Module):
    """Stacked SwiGLU experts; rows arrive grouped by expert."""

    def __init__(self, n: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n, hidden, dim) * dim**-0.5)
        self.w2 = nn.Parameter(torch.randn(n, dim, hidden) * hidden**-0.5)
        self.w3 = nn.Parameter(torch.randn(n, hidden, dim) * dim**-0.5)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        outs = []
        for e, rows in enumerate(torch.split(x, num_tokens_per_expert.tolist())):
            outs.append((F.silu(rows @ w1[e].T) * (rows @ w3[e].T)) @ w2[e].T)
        return torch.cat(outs) if outs else x


class Router(nn.Module):
    def __init__(self, dim: int, n: int):
        super().__init__()
        self.gate = nn.Linear(dim, n, bias=False)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.softmax(self.gate(x).float(), dim=-1)
        _, chosen = torch.topk(scores + bias, TOP_K, dim=-1)  # the bias steers the choice, not the weight
        return scores.gather(1, chosen), chosen


class MoE(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.router = Router(dim, EXPERTS)
        self.experts = Experts(EXPERTS, dim, EXPERT_HIDDEN)
        self.shared_experts = FeedForward(dim, EXPERT_HIDDEN)
        self.register_buffer("expert_bias", torch.zeros(EXPERTS))
        self.register_buffer("tokens_per_expert", torch.zeros(EXPERTS), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, chosen = self.router(x, self.expert_bias)
        counts = torch.bincount(chosen.flatten(), minlength=EXPERTS)
        with torch.no_grad():
            self.tokens_per_expert.add_(counts)
        order = torch.argsort(chosen.flatten(), stable=True)
        rows = x[order // TOP_K] * weights.flatten()[order, None].to(x.dtype)
        out = self.experts(rows, counts)
        routed = out.new_zeros(out.shape).index_copy(0, order, out).view(-1, TOP_K, shape[-1]).sum(1)
        return (routed + self.shared_experts(x)).view(shape)


class MoEBlock(nn.Module):
    def __init__(self, dim: int, heads: int, moe: bool):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.moe = MoE(dim) if moe else None
        self.feed_forward = None if moe else FeedForward(dim, 2 * dim)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), table)
        ffn = self.moe if self.moe is not None else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class ToyMoE(ToyTransformer):
    """The toy transformer with an MoE layer in place of every other block's MLP."""

    def __init__(self, n_layers: int = 2):
        super().__init__(n_layers)
        self.layers = nn.ModuleDict({str(i): MoEBlock(DIM, HEADS, moe=i % 2 == 1) for i in range(n_layers)})

    def moe_layers(self) -> dict[str, nn.Module]:
        return {f"layers.{n}.moe": b.moe for n, b in self.layers.items() if b.moe is not None}

    def tp_plan(self, *, sequence_parallel: bool = True, loss_parallel: bool = True) -> dict:
        between = Shard(1) if sequence_parallel else Replicate()
        return super().tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel) | {
            # The MoE layer sees every token on every tp rank and returns a partial sum over tp:
            # the shared expert's rowwise w2 and the experts (split by titan-parallel) add up there.
            "layers.*.moe": PrepareModuleInputOutput(
                input_layouts=(between,),
                desired_input_layouts=(Replicate(),),
                use_local_input=True,
                output_layouts=(Partial(),),
                desired_output_layouts=(between,),
                use_local_output=True,
            ),
            "layers.*.moe.shared_experts.w1": ColwiseParallel(),
            "layers.*.moe.shared_experts.w2": RowwiseParallel(output_layouts=Partial()),
            "layers.*.moe.shared_experts.w3": ColwiseParallel(),
        }
