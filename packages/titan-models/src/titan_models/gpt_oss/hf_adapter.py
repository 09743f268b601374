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
from titan_models.hf_name_table import TOP_LEVEL, NameTableAdapter, in_block
from titan_models.moe.hf_state import hf_unheld_state, without_training_state, zero_expert_biases

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


class GptOssStateDictAdapter(NameTableAdapter):
    """Converts full (unsharded) gpt-oss state dicts to and from `GptOssForCausalLM`, for one model shape."""

    model_name = "gpt-oss model"
    to_hf_config = staticmethod(to_hf_config)

    def __init__(self, args: GptOssArgs, *, bos_id: int | None = None, eos_id: int | None = None):
        super().__init__(args, bos_id=bos_id, eos_id=eos_id)
        # The trained expert bias, which GptOssForCausalLM has no place for (titan_models.moe.hf_state).
        self.hf_unheld_state = hf_unheld_state(args.moe_args)

    def name_table(self) -> dict[str, str]:
        names = dict(TOP_LEVEL)
        for layer in range(self.args.n_layers):
            names |= in_block(f"layers.{layer}.", f"model.layers.{layer}.", _IN_BLOCK)
        return names

    def _ours_for_hf(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        return without_training_state(state)  # the expert bias left out

    def _to_hf_layout(self, name: str, tensor: Tensor) -> Tensor:
        return tensor.transpose(1, 2) if name.endswith(_TRANSPOSED) else tensor

    _from_hf_layout = _to_hf_layout  # a transpose undoes itself

    def _ours_from_hf(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        blocks = [f"layers.{i}." for i in range(self.args.n_layers)]
        return state | zero_expert_biases(self.args.moe_args, blocks)
