"""The frame every decoder family shares: embedding, a dict of blocks, final norm, output projection.

Llama, Qwen3, Llama 4 and DeepSeek-V3 differ only inside their blocks, in their rotary table and in
their attention masks. Everything around the blocks (building the frame with torchtitan 0.2.2's
parameter names, tying the embedding, seeded layout-independent init, the forward prelude and the
hooks parallelisms call) lives here once, so a fix to it reaches every family.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from titan_models.attention import check_attention_backend
from titan_models.attention_masks import (
    SequenceShard,
    build_attention_mask,
    document_ids,
    document_mask,
    documents_from_positions,
    flex_can_run,
    gathered_attention_mask,
)
from titan_models.errors import ModelConfigError, ModelError
from titan_models.init import DEPTH_SCALED, INPUT_PROJECTIONS, init_parameters
from titan_models.moe.tensor_parallel_plan import moe_tp_entries
from titan_models.rope import rotary_frequencies
from titan_models.tensor_parallel_plan import decoder_tp_plan


class Decoder(nn.Module):
    """A decoder-only transformer. Build it on the meta device, materialise, then call `init_weights`.

    A family subclasses it and says how to build block `layer` (`build_block`); it may replace the
    rotary table (`_rotary_table`), the masks its blocks take (`_attention_masks`) and the attention
    entries of its tensor-parallel plan (`attention_tp_entries`). Blocks live in a `ModuleDict` keyed
    "0".."n-1" so that pipeline stages can drop blocks and keep the same parameter names.
    """

    # Parameter-name endings of a block's input projections (initialised with std 0.02).
    input_projections: tuple[str, ...] = INPUT_PROJECTIONS
    # Parameter-name endings drawn with the depth-scaled std.
    depth_scaled: tuple[str, ...] = DEPTH_SCALED
    # The dtype initial weights are drawn in before the copy into the parameter; None: its own.
    init_draw_dtype: torch.dtype | None = None

    def __init__(self, args: Any):
        super().__init__()
        check_attention_backend(args)
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): self.build_block(i) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=self.final_norm_eps())
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            # One Parameter under two names: state dicts carry both keys, parameters() yields it once.
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("freqs_cis", self._rotary_table(), persistent=False)

    def build_block(self, layer: int) -> nn.Module:
        """The block at index `layer`, called once per layer by `__init__`."""
        raise NotImplementedError

    def final_norm_eps(self) -> float | None:
        """The eps of the norm before the output projection (None: torch's default)."""
        return self.args.norm_eps

    def _rotary_table(self) -> torch.Tensor:
        a = self.args
        return rotary_frequencies(a.head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling)

    @classmethod
    def takes_positions(cls) -> bool:
        """Whether `forward` takes per-token `positions` (packed chat rows): not where the family builds
        its own attention masks (gpt-oss's windows and sinks, Llama 4's chunks), which have no
        document mask from restarting positions yet. The trainer refuses packing at start with it."""
        return cls._attention_masks is Decoder._attention_masks

    _gathered: SequenceShard | None = None

    def set_gathered_sequence(self, shard: SequenceShard | None) -> None:
        """Attend over the sequence gathered through `shard` until called with None: context parallelism
        over packed documents, or with ptrr's dealing (`titan_parallel.gathered_context_parallel`). Rotary
        angles follow the shard's positions (or the row's own, for chat rows), the mask its documents."""
        if shard is not None and not self.takes_positions():
            raise ModelError(
                f"model: {type(self).__name__} builds its own attention masks, which context parallelism over "
                "packed documents (or ptrr) cannot deal per row; use the headtail load balancer on unpacked rows"
            )
        self._gathered = shard

    def _attention_masks(self, doc_ids: torch.Tensor | None, seq_len: int, device: torch.device) -> Any:
        """What every block's attention takes as its mask (Llama 4 passes a pair)."""
        return build_attention_mask(self.args, doc_ids, device)

    def attention_tp_entries(self) -> dict[str, ParallelStyle]:
        """The tensor-parallel styles of the attention's own projections (besides `wo`)."""
        raise NotImplementedError

    def to_empty(self, *, device, recurse: bool = True) -> Decoder:
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

    def init_weights(self, buffer_device: torch.device | None = None, seed: int | None = None) -> None:
        """Initialise every parameter in place, after `to_empty`; sharded parameters too.

        The result depends only on `seed` (default: the seed given to `torch.manual_seed`), never on
        the parallel layout (see `titan_models.init`). The rotary table is rebuilt on `buffer_device`
        and MoE load-balancing state starts at zero.
        """
        device = buffer_device or self.freqs_cis.device
        with torch.device(device):
            self.freqs_cis = self._rotary_table()
        for moe in self.moe_layers().values():
            moe.init_buffers(device)
        init_parameters(
            self,
            self.args,
            torch.initial_seed() if seed is None else seed,
            input_projections=self.input_projections,
            depth_scaled=self.depth_scaled,
            draw_dtype=self.init_draw_dtype,
            family_filler=self.parameter_filler,
        )

    def parameter_filler(self, name: str) -> Callable[[torch.Tensor, torch.Generator], None] | None:
        """A family's own initialisation of parameter `name` (`init_parameters`' family_filler); None:
        Titan's shared rules."""
        return None

    def moe_layers(self) -> dict[str, nn.Module]:
        """FQN -> MoE module, for the blocks this model (or pipeline stage) holds; empty for dense ones.

        Expert parallelism and load balancing (`titan_models.moe.update_expert_bias`) reach MoE here.
        """
        return {
            f"layers.{name}.moe": block.moe
            for name, block in self.layers.items()
            if getattr(block, "moe_enabled", False)
        }

    def linears_not_adapted(self) -> tuple[str, ...]:
        """The linear layers LoRA's all-linear leaves out, by last name segment: the output head and
        each MoE router's linears (`gate`)."""
        routers = {
            name.rsplit(".", 1)[-1]
            for moe in self.moe_layers().values()
            for name, module in moe.router.named_modules()
            if isinstance(module, nn.Linear)
        }
        return ("output", *sorted(routers))

    def hidden_matrices(self) -> dict[str, int]:
        """Parameter FQN -> stacked dims, for Muon: every 2-D weight of the blocks but the MoE routers,
        and the experts' stacked [E, out, in] weights (their stacked biases are not matrices)."""
        moe = self.moe_layers().values()
        routers = {id(p) for layer in moe for p in layer.router.parameters()}
        experts = {id(p) for layer in moe for p in layer.experts.parameters()}
        in_blocks = {id(p) for block in self.parallel_blocks().values() for p in block.parameters()}
        matrices = {}
        for name, p in self.named_parameters():
            if id(p) not in in_blocks or id(p) in routers:
                continue
            stacked = 1 if id(p) in experts else 0
            if p.ndim == stacked + 2:
                matrices[name] = stacked
        return matrices

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
        sharded over the vocabulary (use `torch.distributed.tensor.parallel.loss_parallel`). MoE layers:
        see `titan_models.moe.tensor_parallel_plan`.
        """
        # A tied embedding/output matrix is vocabulary-sharded alike by both styles (Shard(0)), so the
        # two modules can hold one sharded parameter: the TP step re-ties the copies parallelize_module
        # makes, and `to_empty` keeps them tied when the model leaves the meta device.
        plan = decoder_tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
        plan |= self.attention_tp_entries()
        if self.moe_layers():
            moe = self.args.moe_args
            plan |= moe_tp_entries(
                sequence_parallel=sequence_parallel,
                split_shared_experts=moe.score_before_experts,
                has_shared_experts=moe.num_shared_experts > 0,
            )
        return plan

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

    def packed_document_ids(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """(batch, seq) document indices of `tokens` (documents end at `eos_id`) under block-causal
        attention; None under causal attention, which does not follow documents."""
        if self.args.attn_mask_type != "block_causal":
            return None
        return document_ids(tokens, self.args.eos_id)

    def forward(
        self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits (batch, seq, vocab) for token ids (batch, seq).

        On a pipeline stage without the embedding, `tokens` is the previous stage's hidden state.
        `doc_ids` (batch, seq) index the packed documents for block-causal attention; by default
        they come from the token ids and `eos_id` (`document_ids`), which such a stage must be given.
        `positions` (batch, seq), for rows of packed conversations, restart at 0 at each one: rotary
        angles follow them and attention stays within each conversation, whatever `attn_mask_type`.
        """
        if self._gathered is not None:
            return self._forward_gathered(tokens, positions)
        if positions is not None:
            return self._forward_at(tokens, positions)
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
                    "forward(h, doc_ids=model.packed_document_ids(tokens))"
                )
            doc_ids = self.packed_document_ids(tokens)
        masks = self._attention_masks(doc_ids, seq_len, tokens.device)
        return self._blocks_forward(tokens, self.freqs_cis, masks)

    def _blocks_forward(self, tokens: torch.Tensor, freqs_cis: torch.Tensor, masks: Any) -> torch.Tensor:
        # Pipeline stages may have dropped the embedding, norm or output (set to None).
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for block in self.layers.values():
            h = block(h, freqs_cis, masks)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def _forward_at(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`forward` for rows with their own positions: the rotary table gathered per token, and a
        document mask found where positions restart."""
        if not self.takes_positions():
            raise ModelError(
                f"model: {type(self).__name__} builds its own attention masks and does not take per-token "
                "positions yet; train without packing, or fine-tune a family whose `takes_positions()` is True"
            )
        device = tokens.device
        use_flex = self.args.attn_backend == "flex" and flex_can_run(device)
        masks = document_mask(self.args, documents_from_positions(positions), use_flex)
        return self._blocks_forward(tokens, self.freqs_cis[positions], masks)

    def _forward_gathered(self, tokens: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """`forward` over this rank's dealt tokens: rotary at their global positions (or their rows' own
        `positions`), attention over the gathered sequence."""
        shard, batch = self._gathered, tokens.shape[0]
        rotary = positions if positions is not None else shard.positions.expand(batch, -1)
        use_flex = self.args.attn_backend == "flex" and flex_can_run(tokens.device)
        mask = gathered_attention_mask(shard, batch, use_flex)
        return self._blocks_forward(tokens, self.freqs_cis[rotary], mask)
