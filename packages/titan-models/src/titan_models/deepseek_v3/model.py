"""The DeepSeek-V3 decoder: MLA attention, then a dense SwiGLU (first blocks) or an MoE, between RMSNorms."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from titan_models.attention_masks import AttentionMask, build_attention_mask, document_ids
from titan_models.deepseek_v3.args import DeepSeekV3Args
from titan_models.deepseek_v3.attention import MultiHeadLatentAttention
from titan_models.deepseek_v3.init import init_deepseek_parameters
from titan_models.deepseek_v3.rope import deepseek_rotary_table
from titan_models.deepseek_v3.tensor_parallel_plan import deepseek_tp_plan
from titan_models.errors import ModelConfigError, ModelError
from titan_models.moe import MoE
from titan_models.transformer import FeedForward


class DeepSeekV3Block(nn.Module):
    """Pre-norm attention then pre-norm feed-forward (`feed_forward` in dense blocks, `moe` in the others)."""

    def __init__(self, layer: int, args: DeepSeekV3Args):
        super().__init__()
        self.attention = MultiHeadLatentAttention(args)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.moe_enabled = args.is_moe_layer(layer)
        if self.moe_enabled:
            self.moe = MoE(args.moe_args, args.dim, args.moe_inter_dim)
        else:
            self.feed_forward = FeedForward(args.dim, args.inter_dim)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: AttentionMask = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class DeepSeekV3Model(nn.Module):
    """A DeepSeek-V2/V3 decoder with torchtitan 0.2.2's parameter names. Build it on the meta device,
    materialise, then call `init_weights`.

    Satisfies titan-parallel's `TrainableModel`; `moe_layers()` lists the MoE modules for expert
    parallelism and load balancing (`titan_models.moe.update_expert_bias`).
    """

    def __init__(self, args: DeepSeekV3Args):
        super().__init__()
        if args.attn_mask_type == "block_causal" and args.eos_id is None:
            raise ModelConfigError(
                "model: attn_mask_type='block_causal' needs eos_id, the end-of-text token that separates "
                "packed documents (the trainer passes the tokenizer's)"
            )
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): DeepSeekV3Block(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("freqs_cis", deepseek_rotary_table(args), persistent=False)

    def init_weights(self, buffer_device: torch.device | None = None, seed: int | None = None) -> None:
        """Initialise every parameter in place (sharded ones too) from `seed` only; zero the MoE buffers."""
        device = buffer_device or self.freqs_cis.device
        with torch.device(device):
            self.freqs_cis = deepseek_rotary_table(self.args)
        for moe in self.moe_layers().values():
            moe.init_buffers(device)
        init_deepseek_parameters(self, self.args, torch.initial_seed() if seed is None else seed)

    def moe_layers(self) -> dict[str, nn.Module]:
        """FQN -> MoE module, for the blocks this model (or pipeline stage) holds."""
        return {
            f"layers.{name}.moe": block.moe
            for name, block in self.layers.items()
            if block is not None and block.moe_enabled
        }

    def sequence_buffers(self) -> list[tuple[torch.Tensor, int]]:
        """The rotary table, indexed by position along dim 0: context parallelism shards it with the batch."""
        return [(self.freqs_cis, 0)]

    def parallel_blocks(self) -> dict[str, nn.Module]:
        """The repeated blocks by fully-qualified name: the units that parallelisms wrap."""
        return {f"layers.{name}": block for name, block in self.layers.items()}

    def tp_plan(
        self, *, sequence_parallel: bool = True, loss_parallel: bool = True
    ) -> dict[str, ParallelStyle]:
        """Module FQN -> tensor-parallel style (attention heads and dense feed-forwards; experts are left to
        expert parallelism), as `parallelize_module` takes it."""
        return deepseek_tp_plan(
            low_rank_q=self.args.q_lora_rank > 0,
            sequence_parallel=sequence_parallel,
            loss_parallel=loss_parallel,
        )

    def pipeline_units(self) -> list[str]:
        """Top-level FQNs in forward order; a pipeline stage keeps a contiguous run of them."""
        return ["tok_embeddings", *self.parallel_blocks(), "norm", "output"]

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, seq, vocab) for token ids (batch, seq); on a later pipeline stage, `tokens` is
        the previous stage's hidden state and block-causal attention needs `doc_ids`."""
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
        mask = build_attention_mask(self.args, doc_ids, tokens.device)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for block in self.layers.values():
            h = block(h, self.freqs_cis, mask)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h
