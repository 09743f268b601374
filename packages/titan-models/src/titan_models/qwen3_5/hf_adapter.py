"""The mapping between our Qwen3.5 state dicts and Hugging Face's (`Qwen3_5ForCausalLM`,
`Qwen3_5MoeForCausalLM`, and the text weights of `Qwen3_5ForConditionalGeneration` folders).

Names map one to one; both sides rotate halves and keep each head's query beside its gate in `q_proj`. The
linear layers' `in_proj_qkv` rows and convolution channels are permuted from Hugging Face's order (every
query, every key, every value) into ours (grouped by key head, `qwen3_5.linear_attention`), and the
convolution's weight drops Hugging Face's singleton channel dimension ((C, 1, K) <-> (C, K)); our stacked experts (`moe.experts.w1`, (E, hidden, dim)) are the per-expert
matrices transformers writes (`mlp.experts.{e}.gate_proj.weight`). An image-text folder's weights under
`model.language_model.` are read as the text model's; its vision tower (`model.visual.`) and its
multi-token-prediction head (`mtp.`) are skipped, and said so.
"""

from __future__ import annotations

import logging
import re

import torch
from torch import Tensor

from titan_models.hf_name_table import TOP_LEVEL, NameTableAdapter, in_block, per_expert
from titan_models.moe.expert_stacking import stack_experts, unstack_experts
from titan_models.qwen3_5.args import Qwen3_5Args
from titan_models.qwen3_5.hf_config import to_hf_config

logger = logging.getLogger(__name__)

_BLOCK = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_DENSE = {"feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w2.weight": "mlp.down_proj.weight"}
_DENSE |= {"feed_forward.w3.weight": "mlp.up_proj.weight"}
_LINEAR = {f"attention.in_proj_{p}.weight": f"linear_attn.in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")}
_LINEAR |= {
    "attention.conv_weight": "linear_attn.conv1d.weight",
    "attention.A_log": "linear_attn.A_log",
    "attention.dt_bias": "linear_attn.dt_bias",
    "attention.norm.weight": "linear_attn.norm.weight",
    "attention.wo.weight": "linear_attn.out_proj.weight",
}
_FULL = {f"attention.w{p[0]}.weight": f"self_attn.{p}_proj.weight" for p in ("q", "k", "v", "o")}
_FULL |= {
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
_SHARED = {
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.shared_expert.w1.weight": "mlp.shared_expert.gate_proj.weight",
    "moe.shared_expert.w2.weight": "mlp.shared_expert.down_proj.weight",
    "moe.shared_expert.w3.weight": "mlp.shared_expert.up_proj.weight",
    "moe.shared_expert_gate.weight": "mlp.shared_expert_gate.weight",
}
_CONV = re.compile(r"attention\.conv_weight$")
_GROUPED = re.compile(r"attention\.(conv_weight|in_proj_qkv\.weight)$")
_IMAGE_TEXT_PREFIX = "model.language_model."
_SKIPPED = ("model.visual.", "mtp.")


def _grouped_order(args: Qwen3_5Args) -> torch.Tensor:
    """For each of our `in_proj_qkv` rows, the Hugging Face row it holds: per key head g, its query rows,
    its key rows, then the value rows of the value heads it serves."""
    dk, dv = args.linear_key_head_dim, args.linear_value_head_dim
    heads, per_key = args.linear_num_key_heads, args.linear_num_value_heads // args.linear_num_key_heads
    keys = heads * dk
    order = [
        torch.cat(
            [
                torch.arange(g * dk, (g + 1) * dk),
                keys + torch.arange(g * dk, (g + 1) * dk),
                2 * keys + torch.arange(g * per_key * dv, (g + 1) * per_key * dv),
            ]
        )
        for g in range(heads)
    ]
    return torch.cat(order)


class Qwen3_5StateDictAdapter(NameTableAdapter):
    """Converts full (unsharded) Qwen3.5 state dicts to and from Hugging Face's, for one model shape."""

    model_name = "Qwen3.5 model"
    to_hf_config = staticmethod(to_hf_config)

    def __init__(self, args: Qwen3_5Args, *, bos_id: int | None = None, eos_id: int | None = None):
        super().__init__(args, bos_id=bos_id, eos_id=eos_id)
        self._grouped = _grouped_order(args)  # ours[i] = theirs[_grouped[i]]
        self._ungrouped = torch.argsort(self._grouped)

    def name_table(self) -> dict[str, str]:
        args, moe = self.args, self.args.moe_args
        names = dict(TOP_LEVEL)
        for layer in range(args.n_layers):
            ours, theirs = f"layers.{layer}.", f"model.layers.{layer}."
            block = _BLOCK | (_LINEAR if args.is_linear(layer) else _FULL) | (_SHARED if moe else _DENSE)
            names |= in_block(ours, theirs, block)
            if moe:
                names |= per_expert(ours, theirs, moe.num_experts)
        return names

    def _ours_for_hf(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        return unstack_experts(state)

    def _to_hf_layout(self, name: str, tensor: Tensor) -> Tensor:
        if _GROUPED.search(name):
            tensor = tensor[self._ungrouped]
        return tensor.unsqueeze(1) if _CONV.search(name) else tensor

    def _hf_for_ours(self, hf_state: dict[str, Tensor]) -> dict[str, Tensor]:
        """A text model's weights, an image-text folder's read under the text model's names."""
        skipped = sorted({p for name in hf_state for p in _SKIPPED if name.startswith(p)})
        if skipped:
            logger.info(
                "qwen3_5: skipping the checkpoint's %s weights (Titan builds the text model only)", skipped
            )
        return {
            ("model." + k.removeprefix(_IMAGE_TEXT_PREFIX) if k.startswith(_IMAGE_TEXT_PREFIX) else k): t
            for k, t in hf_state.items()
            if not k.startswith(_SKIPPED)
        }

    def _from_hf_layout(self, name: str, tensor: Tensor) -> Tensor:
        if _CONV.search(name):
            tensor = tensor.squeeze(1)
        return tensor[self._grouped] if _GROUPED.search(name) else tensor

    def _ours_from_hf(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        return stack_experts(state)
