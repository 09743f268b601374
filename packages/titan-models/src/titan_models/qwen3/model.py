"""The Qwen3 decoder: Llama's block with per-head RMS-normalised queries and keys, half-split rotary
embeddings, a head width of its own, and optionally a mixture-of-experts feed-forward.

Everything Qwen3 shares with Llama is Titan's Llama code: the attention kernels and masks, the rotary
table, SwiGLU, the weight initialisation and the parallelism hooks (`parallel_blocks`, `tp_plan`,
`pipeline_units`, `sequence_buffers`, `init_weights`) come from `titan_models.Transformer`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from titan_models.attention import Attention, attend, check_attention_backend
from titan_models.attention_masks import AttentionMask
from titan_models.moe import MoE
from titan_models.qwen3.args import Qwen3Args
from titan_models.qwen3.init import init_moe_model
from titan_models.qwen3.rotary import apply_rotary_half_split
from titan_models.qwen3.tensor_parallel_plan import moe_tp_entries, qk_norm_tp_entries
from titan_models.transformer import FeedForward, Transformer


class Qwen3Attention(Attention):
    """Grouped-query attention with RMSNorm over each query and key head before the rotation."""

    def __init__(self, args: Qwen3Args):
        super().__init__(args)
        self.q_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps) if args.qk_norm else None
        self.k_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps) if args.qk_norm else None

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
        bs, seq_len, _ = x.shape
        # -1 rather than n_heads: under tensor parallelism each rank holds a slice of the heads.
        xq = self.wq(x).view(bs, seq_len, -1, self.head_dim)
        xk = self.wk(x).view(bs, seq_len, -1, self.head_dim)
        xv = self.wv(x).view(bs, seq_len, -1, self.head_dim)
        if self.q_norm is not None:
            xq, xk = self.q_norm(xq), self.k_norm(xk)
        xq, xk = apply_rotary_half_split(xq, xk, freqs_cis)
        out = attend(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), self.backend, mask)
        return self.wo(out.transpose(1, 2).reshape(bs, seq_len, -1))


class Qwen3Block(nn.Module):
    """Pre-norm attention then pre-norm feed-forward (`feed_forward`, or `moe` in MoE flavors)."""

    def __init__(self, args: Qwen3Args):
        super().__init__()
        self.attention = Qwen3Attention(args)
        self.moe_enabled = args.moe_enabled
        if self.moe_enabled:
            self.moe = MoE(args.moe_args, dim=args.dim, hidden_dim=args.moe_inter_dim)
        else:
            self.feed_forward = FeedForward(args.dim, args.hidden_dim)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: AttentionMask = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class Qwen3Model(Transformer):
    """A Qwen3 decoder with torchtitan 0.2.2's parameter names. Build it on the meta device,
    materialise, then call `init_weights(buffer_device, seed)`."""

    def __init__(self, args: Qwen3Args):
        # Titan's Transformer.__init__ would build Llama blocks; the Qwen3 parts are built here and
        # every other method (tying, rotary table, init, parallelism hooks, forward) is inherited.
        nn.Module.__init__(self)
        check_attention_backend(args)
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): Qwen3Block(args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("freqs_cis", self._rotary_table(), persistent=False)

    def init_weights(self, buffer_device: torch.device | None = None, seed: int | None = None) -> None:
        """Initialise every parameter in place (sharded ones too) from `seed` alone, rebuild the rotary
        table on `buffer_device` and zero the MoE load-balancing state (see `qwen3.init`)."""
        device = buffer_device or self.freqs_cis.device
        with torch.device(device):
            self.freqs_cis = self._rotary_table()
        init_moe_model(self, self.args, torch.initial_seed() if seed is None else seed, device)

    def tp_plan(
        self, *, sequence_parallel: bool = True, loss_parallel: bool = True
    ) -> dict[str, ParallelStyle]:
        """Llama's plan (attention heads and dense SwiGLUs split Megatron-style), the QK norms split by head
        and MoE layers replicated (see `qwen3.tensor_parallel_plan`)."""
        plan = super().tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
        if self.args.qk_norm:
            plan |= qk_norm_tp_entries()
        return plan | (moe_tp_entries(sequence_parallel=sequence_parallel) if self.moe_layers() else {})

    def moe_layers(self) -> dict[str, nn.Module]:
        """The MoE feed-forwards this model (or pipeline stage) holds, by FQN; empty for dense flavors."""
        return {f"layers.{name}.moe": b.moe for name, b in self.layers.items() if b.moe_enabled}
