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

from titan_models.hf_adapter import checked_keys
from titan_models.qwen3_5.args import Qwen3_5Args
from titan_models.qwen3_5.hf_config import to_hf_config

logger = logging.getLogger(__name__)

_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
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
_EXPERT = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_CONV = re.compile(r"attention\.conv_weight$")
_GROUPED = re.compile(r"attention\.(conv_weight|in_proj_qkv\.weight)$")
_STACKED = re.compile(r"^layers\.\d+\.moe\.experts\.w[123]$")
_WRAPPER_PARTS = re.compile(r"(_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module)\.")
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


class Qwen3_5StateDictAdapter:
    """Converts full (unsharded) Qwen3.5 state dicts to and from Hugging Face's, for one model shape."""

    def __init__(self, args: Qwen3_5Args, *, bos_id: int | None = None, eos_id: int | None = None):
        self.args = args
        self.bos_id, self.eos_id = bos_id, eos_id
        self._to_hf_names = dict(_TOP_LEVEL)
        moe = args.moe_args
        for layer in range(args.n_layers):
            ours, theirs = f"layers.{layer}.", f"model.layers.{layer}."
            names = _BLOCK | (_LINEAR if args.is_linear(layer) else _FULL) | (_SHARED if moe else _DENSE)
            self._to_hf_names |= {ours + k: theirs + v for k, v in names.items()}
            for e in range(moe.num_experts if moe else 0):
                for w, proj in _EXPERT.items():
                    self._to_hf_names[f"{ours}moe.experts.{w}.{e}"] = f"{theirs}mlp.experts.{e}.{proj}.weight"
        self._from_hf_names = {theirs: ours for ours, theirs in self._to_hf_names.items()}
        self._grouped = _grouped_order(args)  # ours[i] = theirs[_grouped[i]]
        self._ungrouped = torch.argsort(self._grouped)

    def to_hf(self, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        """Our names and layout -> `Qwen3_5(Moe)ForCausalLM`'s."""
        state = {}
        for name, tensor in state_dict.items():
            name = _WRAPPER_PARTS.sub("", name)
            if _STACKED.match(name):
                state |= {f"{name}.{e}": tensor[e] for e in range(tensor.shape[0])}
            else:
                state[name] = tensor
        state = checked_keys(self.args, state, self._to_hf_names, "output.weight", "Titan", "Qwen3.5 model")
        return {self._to_hf_names[k]: self._to_hf_layout(k, t) for k, t in state.items()}

    def _to_hf_layout(self, name: str, tensor: Tensor) -> Tensor:
        if _GROUPED.search(name):
            tensor = tensor[self._ungrouped]
        return tensor.unsqueeze(1) if _CONV.search(name) else tensor

    def _text_weights(self, hf_state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        """A text model's weights, an image-text folder's read under the text model's names."""
        skipped = sorted({p for name in hf_state_dict for p in _SKIPPED if name.startswith(p)})
        if skipped:
            logger.info(
                "qwen3_5: skipping the checkpoint's %s weights (Titan builds the text model only)", skipped
            )
        return {
            ("model." + k.removeprefix(_IMAGE_TEXT_PREFIX) if k.startswith(_IMAGE_TEXT_PREFIX) else k): t
            for k, t in hf_state_dict.items()
            if not k.startswith(_SKIPPED)
        }

    def from_hf(self, hf_state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        """Hugging Face's names and layout -> ours (what `Qwen3_5Model.load_state_dict` takes)."""
        hf = checked_keys(
            self.args,
            self._text_weights(hf_state_dict),
            self._from_hf_names,
            "lm_head.weight",
            "Hugging Face",
            "Qwen3.5 model",
        )
        ours, experts = {}, {}
        for name, tensor in hf.items():
            key = self._from_hf_names[name]
            if _CONV.search(key):
                tensor = tensor.squeeze(1)
            if _GROUPED.search(key):
                tensor = tensor[self._grouped]
            stacked, _, e = key.rpartition(".")
            if _STACKED.match(stacked):
                experts.setdefault(stacked, {})[int(e)] = tensor
            else:
                ours[key] = tensor
        for name, per_expert in experts.items():
            ours[name] = torch.stack([per_expert[e] for e in range(len(per_expert))])
        if self.args.tie_word_embeddings:
            ours["output.weight"] = ours["tok_embeddings.weight"]
        return ours

    def hf_config(self) -> dict:
        """The `config.json` of the equivalent Hugging Face text model (see `qwen3_5.hf_config.to_hf_config`)."""
        return to_hf_config(self.args, bos_id=self.bos_id, eos_id=self.eos_id)
