"""The mapping between our Qwen3 state dicts and Hugging Face's `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM`.

Names map one to one as for Llama (`LLAMA_BLOCK`), plus the per-head query/key norms. Both sides rotate
halves (see `titan_models.half_split_rotary`), so no projection is permuted. Our stacked expert weights
(`moe.experts.w1` of shape (E, hidden, dim)) are Hugging Face's per-expert matrices
(`mlp.experts.{e}.gate_proj.weight`, (hidden, dim)) stacked along a new first dimension. The
load-balancing `expert_bias` has no Hugging Face counterpart: an export leaves it out and an import
starts it at zero.
"""

from __future__ import annotations

from torch import Tensor

from titan_models.hf_adapter import LLAMA_BLOCK
from titan_models.hf_name_table import TOP_LEVEL, NameTableAdapter, in_block, per_expert
from titan_models.moe.expert_stacking import stack_experts, unstack_experts
from titan_models.moe.hf_state import hf_unheld_state, without_training_state, zero_expert_biases
from titan_models.qwen3.args import Qwen3Args
from titan_models.qwen3.hf_config import to_hf_config

_QK_NORMS = {
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
_DENSE = ("feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight")


class Qwen3StateDictAdapter(NameTableAdapter):
    """Converts full (unsharded) Qwen3 state dicts to and from Hugging Face's, for one model shape."""

    to_hf_config = staticmethod(to_hf_config)

    def __init__(self, args: Qwen3Args, *, bos_id: int | None = None, eos_id: int | None = None):
        super().__init__(args, bos_id=bos_id, eos_id=eos_id)
        # The trained expert bias, which Qwen3MoeForCausalLM has no place for (titan_models.moe.hf_state).
        self.hf_unheld_state = hf_unheld_state(args.moe_args)

    def name_table(self) -> dict[str, str]:
        args, moe = self.args, self.args.moe_args
        block = LLAMA_BLOCK | (_QK_NORMS if args.qk_norm else {})
        if moe is not None:
            block = {k: v for k, v in block.items() if k not in _DENSE}
            block["moe.router.gate.weight"] = "mlp.gate.weight"
        names = dict(TOP_LEVEL)
        for layer in range(args.n_layers):
            ours, theirs = f"layers.{layer}.", f"model.layers.{layer}."
            names |= in_block(ours, theirs, block)
            if moe is not None:
                names |= per_expert(ours, theirs, moe.num_experts)
        return names

    def _ours_for_hf(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        return unstack_experts(without_training_state(state))

    def _ours_from_hf(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        blocks = [f"layers.{layer}." for layer in range(self.args.n_layers)]
        return stack_experts(state) | zero_expert_biases(self.args.moe_args, blocks)
