"""The Llama transformer: blocks of attention and SwiGLU feed-forward between RMSNorms."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_models.args import ModelArgs
from titan_models.attention import Attention
from titan_models.init import init_parameters
from titan_models.rope import rotary_frequencies


class FeedForward(nn.Module):
    """SwiGLU: `w2(silu(w1 x) * w3 x)`."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """One repeated block: pre-norm attention then pre-norm feed-forward, each residual."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """A Llama 2/3 decoder. Build it on the meta device, materialise, then call `init_weights`.

    Blocks live in a `ModuleDict` keyed "0".."n-1" so that pipeline stages can drop blocks and keep
    the same parameter names, which keeps checkpoints portable across layouts.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("freqs_cis", self._rotary_table(), persistent=False)

    def _rotary_table(self) -> torch.Tensor:
        return rotary_frequencies(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta)

    def init_weights(self, buffer_device: torch.device | None = None, seed: int | None = None) -> None:
        """Initialise every parameter in place, after `to_empty`; sharded parameters too.

        The result depends only on `seed` (default: the seed given to `torch.manual_seed`), never on
        the parallel layout: see `titan_models.init`.
        """
        device = buffer_device or self.freqs_cis.device
        with torch.device(device):
            self.freqs_cis = self._rotary_table()
        init_parameters(self, self.args, torch.initial_seed() if seed is None else seed)

    def parallel_blocks(self) -> dict[str, nn.Module]:
        """The repeated blocks by fully-qualified name: the units that parallelisms wrap."""
        return {f"layers.{name}": block for name, block in self.layers.items()}

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # Pipeline stages may have dropped the embedding, norm or output (set to None).
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for block in self.layers.values():
            h = block(h, self.freqs_cis)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h
