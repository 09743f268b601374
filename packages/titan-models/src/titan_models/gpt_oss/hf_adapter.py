"""The mapping between our gpt-oss state dicts (torchtitan 0.2.2's names) and transformers'
`GptOssForCausalLM` bf16 layout.

Names map one to one, biases and sinks included; both sides rotate halves, so nothing is permuted.
The experts are stacked on both sides but transposed: ours multiply as `x @ w.T` (`mlp1_weight`
(E, 2 * hidden, dim)), transformers' as `x @ w` (`gate_up_proj` (E, dim, 2 * hidden)); gate and up
stay interleaved (even columns gate, odd up) on both. A published MXFP4 folder reaches this mapping
already decoded under the bf16 names (`titan_ckpt.mxfp4_blocks`), its transpose still lazy. The
load-balancing `expert_bias` has no Hugging Face counterpart: an export leaves it out (titan_ckpt
refuses or keeps a trained one) and an import starts it at zero.
"""

from __future__ import annotations

from torch import Tensor

from titan_models.gpt_oss.args import GptOssArgs
from titan_models.gpt_oss.hf_config import to_hf_config
from titan_models.hf_adapter import _WRAPPER_PARTS, checked_keys
from titan_models.moe.hf_state import TRAINING_STATE, hf_unheld_state, zero_expert_biases

_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_IN_BLOCK = {
    **{
        f"attention.{ours}.{kind}": f"self_attn.{theirs}.{kind}"
        for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj"))
        for kind in ("weight", "bias")
    },
    "attention.sinks": "self_attn.sinks",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "moe.router.gate.weight": "mlp.router.weight",
    "moe.router.gate.bias": "mlp.router.bias",
    "moe.experts.mlp1_weight": "mlp.experts.gate_up_proj",
    "moe.experts.mlp1_bias": "mlp.experts.gate_up_proj_bias",
    "moe.experts.mlp2_weight": "mlp.experts.down_proj",
    "moe.experts.mlp2_bias": "mlp.experts.down_proj_bias",
}
_TRANSPOSED = ("moe.experts.mlp1_weight", "moe.experts.mlp2_weight")


class GptOssStateDictAdapter:
    """Converts full (unsharded) gpt-oss state dicts to and from `GptOssForCausalLM`, for one model shape.

    With tied embeddings `to_hf` leaves out `lm_head.weight` and `from_hf` restores `output.weight`."""

    def __init__(self, args: GptOssArgs, *, bos_id: int | None = None, eos_id: int | None = None):
        self.args = args
        self.bos_id, self.eos_id = bos_id, eos_id
        self._to_hf_names = dict(_TOP_LEVEL)
        for layer in range(args.n_layers):
            for ours, theirs in _IN_BLOCK.items():
                self._to_hf_names[f"layers.{layer}.{ours}"] = f"model.layers.{layer}.{theirs}"
        self._from_hf_names = {theirs: ours for ours, theirs in self._to_hf_names.items()}
        # The trained expert bias, which GptOssForCausalLM has no place for (titan_models.moe.hf_state).
        self.hf_unheld_state = hf_unheld_state(args.moe_args)

    def _checked(self, state: dict[str, Tensor], names: dict[str, str], head: str, kind: str) -> dict:
        return checked_keys(self.args, state, names, head, kind, model="gpt-oss model")

    def to_hf(self, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        """Our names and layout -> `GptOssForCausalLM`'s bf16 names and layout (the expert bias left out)."""
        ours = {
            _WRAPPER_PARTS.sub("", name): t
            for name, t in state_dict.items()
            if not name.endswith(TRAINING_STATE)
        }
        hf = {}
        for name, tensor in self._checked(ours, self._to_hf_names, "output.weight", "Titan").items():
            hf[self._to_hf_names[name]] = tensor.transpose(1, 2) if name.endswith(_TRANSPOSED) else tensor
        return hf

    def from_hf(self, hf_state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        """`GptOssForCausalLM`'s names and layout -> ours, with a zero expert bias where our MoE keeps one."""
        ours = {}
        for name, tensor in self._checked(
            hf_state_dict, self._from_hf_names, "lm_head.weight", "Hugging Face"
        ).items():
            our_name = self._from_hf_names[name]
            ours[our_name] = tensor.transpose(1, 2) if our_name.endswith(_TRANSPOSED) else tensor
        if self.args.tie_word_embeddings:
            ours["output.weight"] = ours["tok_embeddings.weight"]
        return ours | zero_expert_biases(
            self.args.moe_args, [f"layers.{i}." for i in range(self.args.n_layers)]
        )

    def hf_config(self) -> dict:
        """The `config.json` of the equivalent `GptOssForCausalLM` (see `gpt_oss.hf_config.to_hf_config`)."""
        return to_hf_config(self.args, bos_id=self.bos_id, eos_id=self.eos_id)
