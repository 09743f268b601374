"""The mapping between our Llama state dicts and Hugging Face `LlamaForCausalLM`'s.

Names map one to one (`LLAMA_BLOCK`). The query and key projections also differ in layout: our rotary
embedding rotates consecutive pairs of each head's dimensions (Meta's layout), Hugging Face's rotates the
first half against the second, so their output rows are permuted per head.
"""

from __future__ import annotations

from torch import Tensor

from titan_models.args import ModelArgs
from titan_models.hf_config import to_hf_config
from titan_models.hf_name_table import TOP_LEVEL, NameTableAdapter, in_block

# A Llama block's names, ours -> theirs; Qwen3 and Llama 4 start from them.
LLAMA_BLOCK = {
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


def _interleaved_to_half_split(w: Tensor, n_heads: int) -> Tensor:
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _half_split_to_interleaved(w: Tensor, n_heads: int) -> Tensor:
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


class LlamaStateDictAdapter(NameTableAdapter):
    """Converts full (unsharded) state dicts to and from `LlamaForCausalLM` for one model shape."""

    to_hf_config = staticmethod(to_hf_config)
    args: ModelArgs

    def name_table(self) -> dict[str, str]:
        names = dict(TOP_LEVEL)
        for layer in range(self.args.n_layers):
            names |= in_block(f"layers.{layer}.", f"model.layers.{layer}.", LLAMA_BLOCK)
        return names

    def _heads_of(self, name: str) -> int | None:
        """How many heads to permute for a query/key projection; None for every other tensor."""
        if name.endswith("attention.wq.weight"):
            return self.args.n_heads
        if name.endswith("attention.wk.weight"):
            return self.args.kv_heads
        return None

    def _to_hf_layout(self, name: str, tensor: Tensor) -> Tensor:
        heads = self._heads_of(name)
        return tensor if heads is None else _interleaved_to_half_split(tensor, heads)

    def _from_hf_layout(self, name: str, tensor: Tensor) -> Tensor:
        heads = self._heads_of(name)
        return tensor if heads is None else _half_split_to_interleaved(tensor, heads)
