"""The Llama 4 text decoder: Llama's block with interleaved mixture-of-experts feed-forwards and iRoPE
attention (no-rope global layers between chunked rope layers).

The attention kernels, rotary table, SwiGLU and parallelism hooks are Titan's Llama code
(`titan_models.Transformer`); the MoE layer is `titan_models.moe.MoE`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from titan_models.attention import Attention, attend, check_attention_backend
from titan_models.attention_masks import document_ids
from titan_models.errors import ModelError
from titan_models.llama4.args import Llama4Args
from titan_models.llama4.masks import Llama4Masks, build_llama4_masks
from titan_models.moe import MoE
from titan_models.qwen3.init import init_moe_model
from titan_models.qwen3.tensor_parallel_plan import moe_tp_entries
from titan_models.rope import apply_rotary
from titan_models.transformer import FeedForward, Transformer


class Llama4Attention(Attention):
    """Grouped-query attention of one layer: rope (rotated, optionally L2-normalised queries and keys,
    chunked mask) or no-rope (global mask, optionally temperature-scaled queries)."""

    def __init__(self, args: Llama4Args, layer: int):
        super().__init__(args)
        self.use_rope = args.uses_rope(layer)
        self.qk_norm_eps = args.norm_eps if args.use_qk_norm and self.use_rope else None
        self.tune_temperature = args.attn_temperature_tuning and not self.use_rope
        self.floor_scale, self.attn_scale = args.floor_scale, args.attn_scale

    def _temperature(self, seq_len: int, device) -> torch.Tensor:
        """Per-position query scale: sharper attention far into a long context, where no rotation helps."""
        pos = torch.arange(seq_len, device=device, dtype=torch.float32)
        scale = torch.log1p(torch.floor((pos + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
        return scale.view(1, seq_len, 1, 1)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, masks: Llama4Masks) -> torch.Tensor:
        bs, seq_len, _ = x.shape
        xq = self.wq(x).view(bs, seq_len, -1, self.head_dim)
        xk = self.wk(x).view(bs, seq_len, -1, self.head_dim)
        xv = self.wv(x).view(bs, seq_len, -1, self.head_dim)
        if self.use_rope:
            xq, xk = apply_rotary(xq, xk, freqs_cis)
        if self.qk_norm_eps is not None:
            shape = (self.head_dim,)
            xq = F.rms_norm(xq.float(), shape, eps=self.qk_norm_eps).type_as(xq)
            xk = F.rms_norm(xk.float(), shape, eps=self.qk_norm_eps).type_as(xk)
        if self.tune_temperature:
            xq = (xq * self._temperature(seq_len, x.device)).to(xv.dtype)
        mask = masks.rope if self.use_rope else masks.nope
        out = attend(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), self.backend, mask)
        return self.wo(out.transpose(1, 2).reshape(bs, seq_len, -1))


class Llama4Block(nn.Module):
    """Pre-norm attention then pre-norm feed-forward: `moe` on MoE layers, `feed_forward` elsewhere."""

    def __init__(self, args: Llama4Args, layer: int):
        super().__init__()
        self.attention = Llama4Attention(args, layer)
        self.moe_enabled = args.is_moe_layer(layer)
        if self.moe_enabled:
            self.moe = MoE(args.moe_args, dim=args.dim, hidden_dim=args.moe_hidden_dim)
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, masks: Llama4Masks) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, masks)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class Llama4Model(Transformer):
    """A Llama 4 text decoder with torchtitan 0.2.2's parameter names. Build it on the meta device,
    materialise, then call `init_weights(buffer_device, seed)`."""

    def __init__(self, args: Llama4Args):
        # Titan's Transformer.__init__ would build Llama blocks; the Llama 4 parts are built here and
        # tying, the rotary table and the parallelism hooks are inherited.
        nn.Module.__init__(self)
        check_attention_backend(args)
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): Llama4Block(args, i) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("freqs_cis", self._rotary_table(), persistent=False)

    def init_weights(self, buffer_device: torch.device | None = None, seed: int | None = None) -> None:
        """Initialise every parameter in place (sharded ones too) from `seed` alone, rebuild the rotary
        table on `buffer_device` and zero the MoE load-balancing state."""
        device = buffer_device or self.freqs_cis.device
        with torch.device(device):
            self.freqs_cis = self._rotary_table()
        init_moe_model(self, self.args, torch.initial_seed() if seed is None else seed, device)

    def tp_plan(
        self, *, sequence_parallel: bool = True, loss_parallel: bool = True
    ) -> dict[str, ParallelStyle]:
        """Llama's plan (attention heads and dense SwiGLUs split Megatron-style)
        and MoE layers replicated (see `qwen3.tensor_parallel_plan`)."""
        plan = super().tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
        return plan | (moe_tp_entries(sequence_parallel=sequence_parallel) if self.moe_layers() else {})

    def moe_layers(self) -> dict[str, nn.Module]:
        """The MoE feed-forwards this model (or pipeline stage) holds, by FQN."""
        return {f"layers.{name}.moe": b.moe for name, b in self.layers.items() if b.moe_enabled}

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, seq, vocab) for token ids (batch, seq); see `Transformer.forward` for pipeline
        stages and `doc_ids`."""
        seq_len = tokens.shape[1]
        if seq_len > self.args.max_seq_len:
            raise ModelError(
                f"model: input of {seq_len} positions is longer than max_seq_len ({self.args.max_seq_len}); "
                "build the model with a larger max_seq_len"
            )
        if self.args.attn_mask_type == "block_causal" and doc_ids is None:
            if self.tok_embeddings is None:
                raise ModelError(
                    "model: block-causal attention on a stage without the token embedding needs "
                    "forward(h, doc_ids=titan_models.document_ids(tokens, eos_id))"
                )
            doc_ids = document_ids(tokens, self.args.eos_id)
        masks = build_llama4_masks(self.args, doc_ids, seq_len, tokens.device)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for block in self.layers.values():
            h = block(h, self.freqs_cis, masks)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h
