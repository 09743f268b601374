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
from titan_models.hf_adapter import _WRAPPER_PARTS

_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
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
_EXPERTS = {"moe.experts.w1": "gate_proj", "moe.experts.w2": "down_proj", "moe.experts.w3": "up_proj"}
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


class DeepSeekV3StateDictAdapter:
    """Converts full (unsharded) state dicts to and from `DeepseekV3ForCausalLM`'s for one model shape.

    A model without an expert bias (`load_balance_coeff=None`) exports a zero
    `e_score_correction_bias`, and imports only a zero one. The model's `num_mtp_layers`
    multi-token-prediction depths are Hugging Face's layers n_layers, n_layers + 1, ... (DeepSeek-V3's
    layer 61); their copies of the embedding and output head are written from the main ones and not
    read back (the model shares them). Multi-token-prediction layers past those (the published checkpoint
    has one; `mtp_layers` names more) are skipped on import.
    """

    def __init__(
        self,
        args: DeepSeekV3Args,
        *,
        bos_id: int | None = None,
        eos_id: int | None = None,
        mtp_layers: int = 0,
    ):
        self.args = args
        self.bos_id, self.eos_id = bos_id, eos_id
        self.mtp_layers = mtp_layers
        self.has_bias = args.moe_args.load_balance_coeff is not None
        self._names = dict(_TOP_LEVEL)  # ours -> theirs, experts apart
        for layer in range(args.n_layers):
            for ours, theirs in self._block_names(layer).items():
                self._names[f"layers.{layer}.{ours}"] = f"model.layers.{layer}.{theirs}"
        # (Titan prefix, Hugging Face layer) of every MoE block, the MTP depths' included.
        self._moe_layers = [(f"layers.{i}.", i) for i in range(args.n_layers) if args.is_moe_layer(i)]
        self._mtp = range(args.n_layers, args.n_layers + args.num_mtp_layers)
        for layer in self._mtp:
            prefix = f"mtp.layers.{layer}."
            block = {f"block.{ours}": theirs for ours, theirs in self._block_names(layer).items()}
            for ours, theirs in (_MTP | block).items():
                self._names[prefix + ours] = f"model.layers.{layer}.{theirs}"
            self._moe_layers.append((prefix + "block.", layer))
        self.hf_keep_dtype = ("e_score_correction_bias",)  # float32 in transformers, whatever the dtype

    def _block_names(self, layer: int) -> dict[str, str]:
        """Block `layer`'s names, ours -> theirs (within the block), routed experts apart."""
        block = dict(_ATTENTION)
        for name in ("wq", "wq_a", "q_norm", "wq_b"):
            if (name == "wq") != (self.args.q_lora_rank == 0):
                block.pop(f"attention.{name}.weight")
        return block | (_MOE if self.args.is_moe_layer(layer) else _DENSE)

    def _hf_expert_names(self, layer: int, ours: str) -> list[str]:
        return [
            f"model.layers.{layer}.mlp.experts.{j}.{_EXPERTS[ours]}.weight"
            for j in range(self.args.moe_args.num_experts)
        ]

    def _check(self, have: set[str], expected: set[str], kind: str) -> None:
        missing, unknown = sorted(expected - have), sorted(have - expected)
        if missing or unknown:
            raise WeightMappingError(
                f"model: the {kind} state dict does not fit this model ({self.args.n_layers} layers, "
                f"{self.args.n_dense_layers} dense, {self.args.moe_args.num_experts} experts): missing "
                f"{missing[:5]}, unexpected {unknown[:5]}; check the model flavor against the checkpoint"
            )

    def to_hf(self, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        """Titan's names and stacked experts -> `DeepseekV3ForCausalLM`'s names, one matrix per expert."""
        state = {_WRAPPER_PARTS.sub("", name): t for name, t in state_dict.items()}
        expected = set(self._names)
        expected |= {prefix + ours for prefix, _ in self._moe_layers for ours in _EXPERTS}
        if not self.has_bias:
            expected -= {n for n in expected if n.endswith("moe.expert_bias")}
        self._check(set(state), expected, "Titan")
        hf = {}
        for ours, theirs in self._names.items():
            if ours in state:
                hf[theirs] = state[ours]
            else:  # an expert bias this model does not keep: the neutral one
                hf[theirs] = torch.zeros(self.args.moe_args.num_experts, dtype=torch.float32)
        for prefix, layer in self._moe_layers:
            for ours in _EXPERTS:
                stacked = state[prefix + ours]
                for j, name in enumerate(self._hf_expert_names(layer, ours)):
                    hf[name] = stacked[j]
        for layer in self._mtp:
            for theirs, ours in _MTP_SHARED.items():
                hf[f"model.layers.{layer}.{theirs}"] = state[ours]
        return hf

    def from_hf(self, hf_state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        """`DeepseekV3ForCausalLM`'s names and per-expert matrices -> Titan's (what `load_state_dict` takes)."""
        skipped = self._mtp_layers_in(hf_state_dict)
        shared = {f"model.layers.{layer}.{theirs}" for layer in self._mtp for theirs in _MTP_SHARED}
        state = {
            k: t
            for k, t in hf_state_dict.items()
            if not ((m := _HF_LAYER.match(k)) and int(m.group(1)) in skipped) and k not in shared
        }
        self._check_mtp_present(state)
        theirs_to_ours = {theirs: ours for ours, theirs in self._names.items()}
        expert_names = {
            prefix: {ours: self._hf_expert_names(layer, ours) for ours in _EXPERTS}
            for prefix, layer in self._moe_layers
        }
        expected = set(theirs_to_ours) | {
            name for by in expert_names.values() for names in by.values() for name in names
        }
        self._check(set(state), expected, "Hugging Face")
        ours = {}
        for theirs, name in theirs_to_ours.items():
            if name.endswith("moe.expert_bias") and not self.has_bias:
                if state[theirs].abs().max() > 0:
                    raise WeightMappingError(
                        f"model: {theirs} is not zero but this model has no expert bias; set "
                        "moe_args.load_balance_coeff to keep it"
                    )
                continue
            ours[name] = state[theirs]
        for prefix, by_weight in expert_names.items():
            for name, hf_names in by_weight.items():
                ours[prefix + name] = torch.stack([state[h] for h in hf_names])
        return ours

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

    def hf_config(self) -> dict:
        """The `config.json` of the equivalent `DeepseekV3ForCausalLM` (see `hf_config.to_hf_config`)."""
        return to_hf_config(self.args, bos_id=self.bos_id, eos_id=self.eos_id)
