"""The mapping between Titan's DeepSeek-V3 state dicts and Hugging Face `DeepseekV3ForCausalLM`'s files.

Names map one to one except the routed experts: Titan stacks them (`moe.experts.w1` of shape
(experts, hidden, dim)), the published checkpoints hold one matrix per expert
(`mlp.experts.{j}.gate_proj.weight`). Both rotate interleaved pairs, so no weight is permuted.
"""

from __future__ import annotations

import logging
import re

import torch
from torch import Tensor

from titan_models.deepseek_v3.args import DeepSeekV3Args
from titan_models.deepseek_v3.hf_config import to_hf_config
from titan_models.errors import WeightMappingError
from titan_models.hf_name_table import TOP_LEVEL, NameTableAdapter, in_block, per_expert
from titan_models.moe.expert_stacking import stack_experts, unstack_experts
from titan_models.moe.hf_state import EXPERT_BIAS

_ATTENTION = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_DENSE = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
_MOE = {
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.expert_bias": "mlp.gate.e_score_correction_bias",
    "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
# A multi-token-prediction depth's own tensors (`deepseek_v3.mtp`); its block maps as any MoE block's.
_MTP = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
}
# Copies of the main embedding and output head that the published files keep in each MTP layer; the
# model shares the main ones (as the paper does): written from them, not read back.
_MTP_SHARED = {"embed_tokens.weight": "tok_embeddings.weight", "shared_head.head.weight": "output.weight"}
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.")
logger = logging.getLogger(__name__)


class DeepSeekV3StateDictAdapter(NameTableAdapter):
    """Converts full (unsharded) state dicts to and from `DeepseekV3ForCausalLM`'s for one model shape.

    A model without an expert bias (`load_balance_coeff=None`) exports a zero
    `e_score_correction_bias`, and imports only a zero one. The model's `num_mtp_layers`
    multi-token-prediction depths are Hugging Face's layers n_layers, n_layers + 1, ... (DeepSeek-V3's
    layer 61); their copies of the embedding and output head are written from the main ones and not
    read back (the model shares them). Multi-token-prediction layers past those (the published checkpoint
    has one; `mtp_layers` names more) are skipped on import.
    """

    to_hf_config = staticmethod(to_hf_config)

    def __init__(
        self,
        args: DeepSeekV3Args,
        *,
        bos_id: int | None = None,
        eos_id: int | None = None,
        mtp_layers: int = 0,
    ):
        self.mtp_layers = mtp_layers
        self.has_bias = args.moe_args.load_balance_coeff is not None
        self._mtp = range(args.n_layers, args.n_layers + args.num_mtp_layers)
        super().__init__(args, bos_id=bos_id, eos_id=eos_id)
        self.hf_keep_dtype = ("e_score_correction_bias",)  # float32 in transformers, whatever the dtype

    def name_table(self) -> dict[str, str]:
        """The blocks' names, then each MTP depth's own tensors and block (HF layer n_layers + d)."""
        names = dict(TOP_LEVEL)
        for layer in range(self.args.n_layers):
            names |= self._block_names(f"layers.{layer}.", layer)
        for layer in self._mtp:
            prefix, theirs = f"mtp.layers.{layer}.", f"model.layers.{layer}."
            names |= in_block(prefix, theirs, _MTP) | self._block_names(prefix + "block.", layer)
        return names

    def _block_names(self, ours: str, layer: int) -> dict[str, str]:
        """Block `layer`'s names under our prefix `ours`, ours -> theirs, each routed expert its own."""
        block = dict(_ATTENTION)
        for name in ("wq", "wq_a", "q_norm", "wq_b"):
            if (name == "wq") != (self.args.q_lora_rank == 0):
                block.pop(f"attention.{name}.weight")
        theirs = f"model.layers.{layer}."
        if not self.args.is_moe_layer(layer):
            return in_block(ours, theirs, block | _DENSE)
        return in_block(ours, theirs, block | _MOE) | per_expert(ours, theirs, self.args.moe_args.num_experts)

    def _shape(self) -> str:
        a = self.args
        return f"{a.n_layers} layers, {a.n_dense_layers} dense, {a.moe_args.num_experts} experts"

    def _absent_biases(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """The neutral (zero) bias for each expert bias a model without one does not hold."""
        if self.has_bias:
            return {}
        e = self.args.moe_args.num_experts
        absent = (n for n in self._to_hf_names if n.endswith(EXPERT_BIAS) and n not in state)
        return {
            n: torch.zeros(e, dtype=torch.float32) for n in absent
        }  # one tensor each: files refuse shared ones

    def _ours_for_hf(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        return unstack_experts(state) | self._absent_biases(state)

    def _hf_copies(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """Each MTP layer's copies of the main embedding and output head."""
        return {
            f"model.layers.{layer}.{theirs}": state[ours]
            for layer in self._mtp
            for theirs, ours in _MTP_SHARED.items()
        }

    def _hf_for_ours(self, hf_state: dict[str, Tensor]) -> dict[str, Tensor]:
        """The checkpoint without the MTP layers the model does not train and the MTP layers' copies."""
        skipped = self._mtp_layers_in(hf_state)
        shared = {f"model.layers.{layer}.{theirs}" for layer in self._mtp for theirs in _MTP_SHARED}
        state = {
            k: t
            for k, t in hf_state.items()
            if not ((m := _HF_LAYER.match(k)) and int(m.group(1)) in skipped) and k not in shared
        }
        self._check_mtp_present(state)
        return state

    def _ours_from_hf(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """Experts stacked; a model without an expert bias takes only a zero one, and keeps none."""
        if not self.has_bias:
            for name in [n for n in state if n.endswith(EXPERT_BIAS)]:
                if state.pop(name).abs().max() > 0:
                    raise WeightMappingError(
                        f"model: {self._to_hf_names[name]} is not zero but this model has no expert bias; set "
                        "moe_args.load_balance_coeff to keep it"
                    )
        return stack_experts(state)

    def _check_mtp_present(self, state: dict[str, Tensor]) -> None:
        """Refuse in one line a checkpoint without the MTP layers this model trains."""
        absent = [i for i in self._mtp if f"model.layers.{i}.eh_proj.weight" not in state]
        if absent:
            raise WeightMappingError(
                f"model: num_mtp_layers is {self.args.num_mtp_layers} but the checkpoint has no "
                f"multi-token-prediction layer {', '.join(map(str, absent))} (model.layers.N.eh_proj.weight; "
                "its config.json's num_nextn_predict_layers says how many it has); set model.num_mtp_layers "
                "to that number, or 0 to train without MTP"
            )

    def _mtp_layers_in(self, hf_state_dict: dict[str, Tensor]) -> list[int]:
        """The multi-token-prediction layers of a checkpoint that the model does not train, which the
        import skips (said once): the `mtp_layers` after the model's last block (or MTP depth), and any
        layer past it holding an MTP projection (`eh_proj`), as DeepSeek-V3's layer 61 does
        (`num_nextn_predict_layers`)."""
        n = self.args.n_layers + self.args.num_mtp_layers
        layers = set(range(n, n + self.mtp_layers))
        for name in hf_state_dict:
            if (m := _HF_LAYER.match(name)) and int(m.group(1)) >= n and name.endswith(".eh_proj.weight"):
                layers.add(int(m.group(1)))
        found = sorted(i for i in layers if any(k.startswith(f"model.layers.{i}.") for k in hf_state_dict))
        if found:
            logger.info(
                "model: skipping DeepSeek's multi-token-prediction layer %s (num_nextn_predict_layers; "
                "model.num_mtp_layers trains it)",
                ", ".join(map(str, found)),
            )
        return found
