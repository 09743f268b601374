"""The mapping between our Llama state dicts and Hugging Face `LlamaForCausalLM`'s.

Names map one to one. The query and key projections also differ in layout: our rotary embedding
rotates consecutive pairs of each head's dimensions (Meta's layout), Hugging Face's rotates the
first half against the second, so their output rows are permuted per head.
"""

from __future__ import annotations

import re

from torch import Tensor

from titan_models.args import ModelArgs
from titan_models.errors import WeightMappingError
from titan_models.hf_config import to_hf_config

_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_IN_BLOCK = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
# Wrappers that activation checkpointing and torch.compile insert into parameter names.
_WRAPPER_PARTS = re.compile(r"(_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module)\.")


def _interleaved_to_half_split(w: Tensor, n_heads: int) -> Tensor:
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _half_split_to_interleaved(w: Tensor, n_heads: int) -> Tensor:
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def checked_keys(
    args, state_dict: dict[str, Tensor], names: dict[str, str], head: str, kind: str, model: str = "model"
) -> dict:
    """A copy of `state_dict` without a tied output head (`head`), once its keys are exactly `names`;
    else the mapping error naming what is missing and unexpected (`args`: n_layers, tie_word_embeddings)."""
    state = dict(state_dict)
    expected = set(names)
    if args.tie_word_embeddings:
        state.pop(head, None)
        expected.discard(head)
    missing, unknown = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unknown:
        raise WeightMappingError(
            f"model: the {kind} state dict does not fit this {model} ({args.n_layers} layers, "
            f"tie_word_embeddings={args.tie_word_embeddings}): missing {missing[:5]}, "
            f"unexpected {unknown[:5]}; check the model flavor against the checkpoint"
        )
    return state


class LlamaStateDictAdapter:
    """Converts full (unsharded) state dicts to and from `LlamaForCausalLM` for one model shape.

    With tied embeddings the output projection is the embedding matrix: `to_hf` leaves out
    `lm_head.weight`, as Hugging Face's saved files do, and `from_hf` restores `output.weight`.
    """

    def __init__(self, args: ModelArgs, *, bos_id: int | None = None, eos_id: int | None = None):
        self.args = args
        self.bos_id, self.eos_id = bos_id, eos_id
        self._to_hf_names = dict(_TOP_LEVEL)
        for layer in range(args.n_layers):
            for ours, theirs in _IN_BLOCK.items():
                self._to_hf_names[f"layers.{layer}.{ours}"] = f"model.layers.{layer}.{theirs}"
        self._from_hf_names = {theirs: ours for ours, theirs in self._to_hf_names.items()}

    def _heads_of(self, name: str) -> int | None:
        """How many heads to permute for a query/key projection; None for every other tensor."""
        if name.endswith("attention.wq.weight"):
            return self.args.n_heads
        if name.endswith("attention.wk.weight"):
            return self.args.kv_heads
        return None

    def _checked(self, state_dict: dict[str, Tensor], names: dict[str, str], head: str, kind: str) -> dict:
        return checked_keys(self.args, state_dict, names, head, kind)

    def to_hf(self, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        """Our names and layout -> `LlamaForCausalLM` names and layout."""
        unwrapped = {_WRAPPER_PARTS.sub("", name): t for name, t in state_dict.items()}
        hf = {}
        for name, tensor in self._checked(unwrapped, self._to_hf_names, "output.weight", "Titan").items():
            heads = self._heads_of(name)
            hf[self._to_hf_names[name]] = (
                tensor if heads is None else _interleaved_to_half_split(tensor, heads)
            )
        return hf

    def from_hf(self, hf_state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        """`LlamaForCausalLM` names and layout -> ours (what `Transformer.load_state_dict` takes)."""
        ours = {}
        for name, tensor in self._checked(
            hf_state_dict, self._from_hf_names, "lm_head.weight", "Hugging Face"
        ).items():
            our_name = self._from_hf_names[name]
            heads = self._heads_of(our_name)
            ours[our_name] = tensor if heads is None else _half_split_to_interleaved(tensor, heads)
        if self.args.tie_word_embeddings:
            ours["output.weight"] = ours["tok_embeddings.weight"]
        return ours

    def hf_config(self) -> dict:
        """The `config.json` of the equivalent `LlamaForCausalLM` (see `titan_models.hf_config.to_hf_config`)."""
        return to_hf_config(self.args, bos_id=self.bos_id, eos_id=self.eos_id)
