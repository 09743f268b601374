"""The Llama 4 text decoder: Llama's block with interleaved mixture-of-experts feed-forwards and iRoPE
attention (no-rope global layers between chunked rope layers).

The attention kernels, rotary table and SwiGLU are Titan's Llama code, the frame around the blocks
(init, forward, parallelism hooks) is `titan_models.decoder.Decoder`; the MoE layer is
`titan_models.moe.MoE`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from titan_models.attention import Attention, attend, attention_tail
from titan_models.cached_attention import HeadsCache
from titan_models.decoder import Decoder
from titan_models.decoder_block import DecoderBlock
from titan_models.feed_forward import FeedForward
from titan_models.llama4.args import Llama4Args
from titan_models.llama4.masks import Llama4Masks, build_llama4_masks
from titan_models.moe import MoE
from titan_models.rope import apply_rotary
from titan_models.tensor_parallel_plan import gqa_tp_entries


class ChunkedHeadsCache(HeadsCache):
    """Llama 4's KV cache: a rope layer with `attn_chunk_size` sees only keys of its query's chunk of
    positions (the temperature follows each row's positions through `project`)."""

    def restrict(self, attention, mask, query_pos, key_pos):
        if attention.chunk is None:
            return mask
        same = (query_pos[:, :, None] // attention.chunk) == (key_pos[:, None, :] // attention.chunk)
        return mask & same[:, None]


class Llama4Attention(Attention):
    """Grouped-query attention of one layer: rope (rotated, optionally L2-normalised queries and keys,
    chunked mask) or no-rope (global mask, optionally temperature-scaled queries)."""

    kv_cache = ChunkedHeadsCache()

    def __init__(self, args: Llama4Args, layer: int):
        super().__init__(args)
        self.use_rope = args.uses_rope(layer)
        # Rope layers attend within chunks of this many positions (None: the whole context).
        self.chunk = args.attn_chunk_size if self.use_rope else None
        self.qk_norm_eps = args.norm_eps if args.use_qk_norm and self.use_rope else None
        self.tune_temperature = args.attn_temperature_tuning and not self.use_rope
        self.floor_scale, self.attn_scale = args.floor_scale, args.attn_scale

    def _temperature(self, positions: torch.Tensor) -> torch.Tensor:
        """Query scale at `positions` (batch or 1, seq), each row's own (not its chunk's): sharper
        attention far into a long context, where no rotation helps."""
        pos = positions.to(torch.float32)
        scale = torch.log1p(torch.floor((pos + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
        return scale[:, :, None, None]

    def project(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        xq, xk, xv = self.heads(x)
        if self.use_rope:
            xq, xk = apply_rotary(xq, xk, freqs_cis)
        if self.qk_norm_eps is not None:
            shape = (self.head_dim,)
            xq = F.rms_norm(xq.float(), shape, eps=self.qk_norm_eps).type_as(xq)
            xk = F.rms_norm(xk.float(), shape, eps=self.qk_norm_eps).type_as(xk)
        if self.tune_temperature:
            if positions is None:
                positions = torch.arange(x.shape[1], device=x.device)[None]
            xq = (xq * self._temperature(positions)).to(xv.dtype)
        return xq, xk, xv

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, masks: Llama4Masks) -> torch.Tensor:
        xq, xk, xv = self.project(x, freqs_cis)
        mask = masks.rope if self.use_rope else masks.nope
        return attention_tail(self.wo, xq, xk, xv, attend, self.backend, mask)


def llama4_block(args: Llama4Args, layer: int) -> DecoderBlock:
    """Llama 4's attention of `layer`, then `moe` on MoE layers and a SwiGLU `feed_forward` elsewhere."""
    moe = args.is_moe_layer(layer)
    return DecoderBlock(
        Llama4Attention(args, layer),
        dim=args.dim,
        norm_eps=args.norm_eps,
        moe=MoE(args.moe_args, dim=args.dim, hidden_dim=args.moe_hidden_dim) if moe else None,
        feed_forward=None if moe else FeedForward(args.dim, args.ffn_hidden_dim),
    )


class Llama4Model(Decoder):
    """A Llama 4 text decoder with torchtitan 0.2.2's parameter names (frame, init and parallel hooks:
    `titan_models.decoder.Decoder`)."""

    def build_block(self, layer: int) -> nn.Module:
        return llama4_block(self.args, layer)

    def _attention_masks(
        self, doc_ids: torch.Tensor | None, seq_len: int, device: torch.device
    ) -> Llama4Masks:
        return build_llama4_masks(self.args, doc_ids, seq_len, device)

    def attention_tp_entries(self) -> dict[str, ParallelStyle]:
        return gqa_tp_entries()
