"""The mapping between our Qwen3 state dicts and Hugging Face's `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM`.

Names map one to one as for Llama (`LlamaStateDictAdapter`), plus the per-head query/key norms. Both
sides rotate halves (see `titan_models.half_split_rotary`), so no projection is permuted. Our stacked expert weights
(`moe.experts.w1` of shape (E, hidden, dim)) are Hugging Face's per-expert matrices
(`mlp.experts.{e}.gate_proj.weight`, (hidden, dim)) stacked along a new first dimension. The
load-balancing `expert_bias` has no Hugging Face counterpart: an export leaves it out and an import
starts it at zero.
"""

from __future__ import annotations

from torch import Tensor

from titan_models.hf_adapter import LlamaStateDictAdapter
from titan_models.moe.hf_state import hf_unheld_state, zero_expert_biases
from titan_models.qwen3.args import Qwen3Args
from titan_models.qwen3.expert_stacking import ExpertStacking
from titan_models.qwen3.hf_config import to_hf_config

_QK_NORMS = {
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
_DENSE = ("feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight")
_EXPERT = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


class Qwen3StateDictAdapter(LlamaStateDictAdapter):
    """Converts full (unsharded) Qwen3 state dicts to and from Hugging Face's, for one model shape."""

    def __init__(self, args: Qwen3Args, *, bos_id: int | None = None, eos_id: int | None = None):
        super().__init__(args, bos_id=bos_id, eos_id=eos_id)
        moe = args.moe_args
        self.stacking = ExpertStacking(args.n_layers if moe else 0, moe.num_experts if moe else 0)
        for layer in range(args.n_layers):
            ours, theirs = f"layers.{layer}.", f"model.layers.{layer}."
            if args.qk_norm:
                self._to_hf_names |= {ours + k: theirs + v for k, v in _QK_NORMS.items()}
            if moe is None:
                continue
            for name in _DENSE:
                del self._to_hf_names[ours + name]
            self._to_hf_names[ours + "moe.router.gate.weight"] = theirs + "mlp.gate.weight"
            for e in range(moe.num_experts):
                for w, proj in _EXPERT.items():
                    self._to_hf_names[f"{ours}moe.experts.{w}.{e}"] = f"{theirs}mlp.experts.{e}.{proj}.weight"
        self._from_hf_names = {theirs: ours for ours, theirs in self._to_hf_names.items()}
        # The trained expert bias, which Qwen3MoeForCausalLM has no place for (titan_models.moe.hf_state).
        self.hf_unheld_state = hf_unheld_state(moe)

    def _heads_of(self, name: str) -> int | None:
        return None  # both layouts rotate halves: nothing to permute

    def to_hf(self, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        """Our names and layout -> Hugging Face's (the expert bias is left out)."""
        return super().to_hf(self.stacking.unstack(state_dict))

    def from_hf(self, hf_state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        """Hugging Face's names and layout -> ours, with a zero expert bias where our MoE layers keep one."""
        ours = self.stacking.stack(super().from_hf(hf_state_dict))
        return ours | zero_expert_biases(self.args.moe_args, self.stacking.blocks())

    def hf_config(self) -> dict:
        """The `config.json` of the equivalent Hugging Face model (see `qwen3.hf_config.to_hf_config`)."""
        return to_hf_config(self.args, bos_id=self.bos_id, eos_id=self.eos_id)
