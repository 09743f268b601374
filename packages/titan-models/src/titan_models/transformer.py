"""The Llama transformer: blocks of attention and SwiGLU feed-forward between RMSNorms."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from titan_models.args import ModelArgs
from titan_models.attention import Attention, check_attention_backend
from titan_models.attention_masks import AttentionMask, build_attention_mask, document_ids
from titan_models.errors import ModelConfigError, ModelError
from titan_models.init import init_parameters
from titan_models.rope import rotary_frequencies
from titan_models.tensor_parallel_plan import llama_tp_plan


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

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: AttentionMask = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """A Llama 2/3 decoder. Build it on the meta device, materialise, then call `init_weights`.

    Blocks live in a `ModuleDict` keyed "0".."n-1" so that pipeline stages can drop blocks and keep
    the same parameter names, which keeps checkpoints portable across layouts.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        check_attention_backend(args)
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            # One Parameter under two names: state dicts carry both keys, parameters() yields it once.
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("freqs_cis", self._rotary_table(), persistent=False)

    def to_empty(self, *, device, recurse: bool = True) -> Transformer:
        """As `nn.Module.to_empty`, keeping a tied embedding/output matrix tied.

        Moving off the meta device gives each module a new Parameter object, which would split the
        shared matrix in two.
        """
        super().to_empty(device=device, recurse=recurse)
        tok, out = self.tok_embeddings, self.output
        if (
            self.args.tie_word_embeddings
            and tok is not None
            and out is not None
            and out.weight is not tok.weight
        ):
            out.weight = tok.weight
        return self

    def _rotary_table(self) -> torch.Tensor:
        a = self.args
        return rotary_frequencies(a.head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling)

    def init_weights(self, buffer_device: torch.device | None = None, seed: int | None = None) -> None:
        """Initialise every parameter in place, after `to_empty`; sharded parameters too.

        The result depends only on `seed` (default: the seed given to `torch.manual_seed`), never on
        the parallel layout: see `titan_models.init`.
        """
        device = buffer_device or self.freqs_cis.device
        with torch.device(device):
            self.freqs_cis = self._rotary_table()
        init_parameters(self, self.args, torch.initial_seed() if seed is None else seed)

    def sequence_buffers(self) -> list[tuple[torch.Tensor, int]]:
        """The rotary table, indexed by position along dim 0: context parallelism shards it with the batch."""
        return [(self.freqs_cis, 0)]

    def parallel_blocks(self) -> dict[str, nn.Module]:
        """The repeated blocks by fully-qualified name: the units that parallelisms wrap."""
        return {f"layers.{name}": block for name, block in self.layers.items()}

    def tp_plan(
        self, *, sequence_parallel: bool = True, loss_parallel: bool = True
    ) -> dict[str, ParallelStyle]:
        """Module FQN -> tensor-parallel style, as `parallelize_module(model, tp_mesh, plan)` takes it.

        Block FQNs use "*" for the block name. Under `loss_parallel` the logits stay a DTensor
        sharded over the vocabulary (use `torch.distributed.tensor.parallel.loss_parallel`).
        """
        if self.args.tie_word_embeddings:
            raise ModelConfigError(
                "model: tensor parallelism would split the tied embedding/output matrix into two separate "
                "parameters; use a flavor with tie_word_embeddings=False, or FSDP only"
            )
        return llama_tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)

    def pipeline_units(self) -> list[str]:
        """Top-level FQNs in forward order; a pipeline stage keeps a contiguous run of them.

        Units a stage does not keep are deleted from `layers` or set to None; `forward` runs on
        what remains.
        """
        if self.args.tie_word_embeddings:
            raise ModelConfigError(
                "model: pipeline stages would hold the tied embedding/output matrix on two stages that "
                "update it separately; use a flavor with tie_word_embeddings=False"
            )
        return ["tok_embeddings", *self.parallel_blocks(), "norm", "output"]

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, seq, vocab) for token ids (batch, seq).

        On a pipeline stage without the embedding, `tokens` is the previous stage's hidden state.
        `doc_ids` (batch, seq) index the packed documents for block-causal attention; by default
        they come from the token ids and `eos_id` (`document_ids`), which such a stage must be given.
        """
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
        # Pipeline stages may have dropped the embedding, norm or output (set to None).
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for block in self.layers.values():
            h = block(h, self.freqs_cis, mask)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h
