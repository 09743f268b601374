"""A small decoder written with torch.nn only (not a Titan model) that describes itself for titan-parallel.

It has what the parallelisms care about: token embeddings, repeated blocks of causal multi-head
attention with rotary positions and a SwiGLU MLP, a final norm and an output head.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

VOCAB, DIM, HEADS, SEQ = 64, 32, 4, 16


def rotary_table(seq_len: int, head_dim: int) -> torch.Tensor:
    """(seq, head_dim/2, 2) cos and sin of each position's rotation angles."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(seq_len).float(), inv_freq)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, seq, heads, head_dim) pairs of features by their position's angle."""
    pairs = x.float().unflatten(-1, (-1, 2))
    cos, sin = table[: x.shape[1], None, :, 0], table[: x.shape[1], None, :, 1]
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism a rank holds a slice of them.
        q, k, v = (w(x).view(b, s, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = rotate(q, table), rotate(k, table)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = FeedForward(dim, 2 * dim)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), table)
        return h + self.feed_forward(self.ffn_norm(h))


class ToyTransformer(nn.Module):
    def __init__(
        self,
        n_layers: int = 2,
        vocab: int = VOCAB,
        dim: int = DIM,
        heads: int = HEADS,
        seq: int = SEQ,
        tied: bool = False,
    ):
        super().__init__()
        self.n_heads = heads
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, heads) for i in range(n_layers)})
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        if tied:  # one matrix for the embedding and the output head
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope", rotary_table(seq, dim // heads), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # A pipeline stage may have dropped the embedding, norm or output (set to None).
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for block in self.layers.values():
            h = block(h, self.rope)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def parallel_blocks(self) -> dict[str, nn.Module]:
        return {f"layers.{name}": block for name, block in self.layers.items()}

    def pipeline_units(self) -> list[str]:
        return ["tok_embeddings", *self.parallel_blocks(), "norm", "output"]

    def tp_plan(self, *, sequence_parallel: bool = True, loss_parallel: bool = True) -> dict:
        between = Shard(1) if sequence_parallel else Replicate()
        plan = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
            "output": ColwiseParallel(
                input_layouts=between,
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            ),
            "layers.*.attention": PrepareModuleInput(
                input_layouts=(between, None), desired_input_layouts=(Replicate(), None)
            ),
            "layers.*.attention.wq": ColwiseParallel(),
            "layers.*.attention.wk": ColwiseParallel(),
            "layers.*.attention.wv": ColwiseParallel(),
            "layers.*.attention.wo": RowwiseParallel(output_layouts=between),
            "layers.*.feed_forward": PrepareModuleInput(
                input_layouts=(between,), desired_input_layouts=(Replicate(),)
            ),
            "layers.*.feed_forward.w1": ColwiseParallel(),
            "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=between),
            "layers.*.feed_forward.w3": ColwiseParallel(),
        }
        if sequence_parallel:
            plan |= {
                "norm": SequenceParallel(),
                "layers.*.attention_norm": SequenceParallel(),
                "layers.*.ffn_norm": SequenceParallel(),
            }
        return plan


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
