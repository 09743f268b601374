"""The mapping between our Llama 4 state dicts and Hugging Face's `Llama4ForCausalLM` (text).

Names map as for Llama (`LlamaStateDictAdapter`) with Llama 4's feed-forward names. Hugging Face's
Llama 4 rotates consecutive pairs, as we do, so no projection is permuted. The routed experts are
fused there: `feed_forward.experts.gate_up_proj` (E, dim, 2 * hidden) holds each expert's gate
(our `w1`, (E, hidden, dim)) and up (`w3`) projections transposed and side by side, and
`feed_forward.experts.down_proj` (E, hidden, dim) is our `w2` transposed. The load-balancing
`expert_bias` has no Hugging Face counterpart: an export leaves it out and an import starts it at zero.
A multimodal checkpoint (`Llama4ForConditionalGeneration`) holds the text model under `language_model.`;
its vision tower and projector are skipped on import, with one log line.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from titan_models.hf_adapter import LlamaStateDictAdapter
from titan_models.llama4.args import Llama4Args
from titan_models.llama4.hf_config import to_hf_config
from titan_models.moe.hf_state import TRAINING_STATE, hf_unheld_state, zero_expert_biases

_DENSE = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
# Our names for the fused tensors while they are renamed (never seen outside this module).
_GATE_UP, _DOWN = "moe.experts.gate_up", "moe.experts.down"
_TEXT_PREFIX = "language_model."
_IMAGE_PARTS = ("vision_model.", "multi_modal_projector.")
logger = logging.getLogger(__name__)


def _text_model(hf_state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """The text model's tensors of a multimodal checkpoint, named as `Llama4ForCausalLM` names them (the
    vision tower and projector skipped, said once); a text checkpoint as it is."""
    if not any(name.startswith(_TEXT_PREFIX) for name in hf_state_dict):
        return hf_state_dict
    skipped = [name for name in hf_state_dict if name.startswith(_IMAGE_PARTS)]
    if skipped:
        logger.info(
            "model: skipping the vision tower and projector of the multimodal Llama 4 checkpoint (%d tensors "
            "under vision_model. and multi_modal_projector.); Titan imports its text model (language_model.)",
            len(skipped),
        )
    return {
        (name[len(_TEXT_PREFIX) :] if name.startswith(_TEXT_PREFIX) else name): t
        for name, t in hf_state_dict.items()
        if not name.startswith(_IMAGE_PARTS)
    }


class Llama4StateDictAdapter(LlamaStateDictAdapter):
    """Converts full (unsharded) Llama 4 state dicts to and from `Llama4ForCausalLM`'s, for one model shape."""

    def __init__(self, args: Llama4Args, *, bos_id: int | None = None, eos_id: int | None = None):
        super().__init__(args, bos_id=bos_id, eos_id=eos_id)
        for layer in range(args.n_layers):
            ours, theirs = f"layers.{layer}.", f"model.layers.{layer}.feed_forward."
            for w, proj in _DENSE.items():
                del self._to_hf_names[f"{ours}feed_forward.{w}.weight"]
                if not args.is_moe_layer(layer):
                    self._to_hf_names[f"{ours}feed_forward.{w}.weight"] = f"{theirs}{proj}.weight"
            if args.is_moe_layer(layer):
                self._to_hf_names |= {
                    f"{ours}moe.shared_experts.{w}.weight": f"{theirs}shared_expert.{proj}.weight"
                    for w, proj in _DENSE.items()
                }
                self._to_hf_names |= {
                    f"{ours}moe.router.gate.weight": f"{theirs}router.weight",
                    f"{ours}{_GATE_UP}": f"{theirs}experts.gate_up_proj",
                    f"{ours}{_DOWN}": f"{theirs}experts.down_proj",
                }
        self._from_hf_names = {theirs: ours for ours, theirs in self._to_hf_names.items()}
        # The trained expert bias, which Llama4ForCausalLM has no place for (titan_models.moe.hf_state).
        self.hf_unheld_state = hf_unheld_state(args.moe_args)

    def _heads_of(self, name: str) -> int | None:
        return None  # both sides rotate consecutive pairs: nothing to permute

    def to_hf(self, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        """Our names and layout -> `Llama4ForCausalLM`'s (the expert bias is left out)."""
        fused: dict[str, Tensor] = {}
        for name, t in state_dict.items():
            if name.endswith((*TRAINING_STATE, "moe.experts.w3")):
                continue
            if name.endswith("moe.experts.w1"):
                w3 = state_dict[name[: -len("w1")] + "w3"]
                fused[name[: -len("moe.experts.w1")] + _GATE_UP] = torch.cat(
                    [t.transpose(1, 2), w3.transpose(1, 2)], dim=2
                ).contiguous()
            elif name.endswith("moe.experts.w2"):
                fused[name[: -len("moe.experts.w2")] + _DOWN] = t.transpose(1, 2).contiguous()
            else:
                fused[name] = t
        return super().to_hf(fused)

    def from_hf(self, hf_state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        """`Llama4ForCausalLM`'s (or a multimodal checkpoint's text model's) names and layout -> ours, with a zero
        expert bias where our MoE layers keep one."""
        ours: dict[str, Tensor] = {}
        moe_blocks = []
        for name, t in super().from_hf(_text_model(hf_state_dict)).items():
            if name.endswith(_GATE_UP):
                prefix = name[: -len(_GATE_UP)]
                w1, w3 = t.chunk(2, dim=2)
                ours[prefix + "moe.experts.w1"] = w1.transpose(1, 2).contiguous()
                ours[prefix + "moe.experts.w3"] = w3.transpose(1, 2).contiguous()
                moe_blocks.append(prefix)
            elif name.endswith(_DOWN):
                ours[name[: -len(_DOWN)] + "moe.experts.w2"] = t.transpose(1, 2).contiguous()
            else:
                ours[name] = t
        return ours | zero_expert_biases(self.args.moe_args, moe_blocks)

    def hf_config(self) -> dict:
        """The `config.json` of the equivalent `Llama4ForCausalLM` (see `llama4.hf_config.to_hf_config`)."""
        return to_hf_config(self.args, bos_id=self.bos_id, eos_id=self.eos_id)
