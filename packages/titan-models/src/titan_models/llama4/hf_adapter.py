"""The mapping between our Llama 4 state dicts and Hugging Face's `Llama4ForCausalLM` (text).

Names map as for Llama (`LLAMA_BLOCK`) with Llama 4's feed-forward names. Hugging Face's
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

from titan_models.hf_adapter import LLAMA_BLOCK
from titan_models.hf_name_table import EXPERT_PROJECTIONS, TOP_LEVEL, NameTableAdapter, in_block
from titan_models.llama4.args import Llama4Args
from titan_models.llama4.hf_config import to_hf_config
from titan_models.moe.hf_state import hf_unheld_state, without_training_state, zero_expert_biases

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


class Llama4StateDictAdapter(NameTableAdapter):
    """Converts full (unsharded) Llama 4 state dicts to and from `Llama4ForCausalLM`'s, for one model shape."""

    to_hf_config = staticmethod(to_hf_config)

    def __init__(self, args: Llama4Args, *, bos_id: int | None = None, eos_id: int | None = None):
        super().__init__(args, bos_id=bos_id, eos_id=eos_id)
        # The trained expert bias, which Llama4ForCausalLM has no place for (titan_models.moe.hf_state).
        self.hf_unheld_state = hf_unheld_state(args.moe_args)

    def name_table(self) -> dict[str, str]:
        attention = {k: v for k, v in LLAMA_BLOCK.items() if not k.startswith("feed_forward.")}
        names = dict(TOP_LEVEL)
        for layer in range(self.args.n_layers):
            ours, theirs = f"layers.{layer}.", f"model.layers.{layer}."
            names |= in_block(ours, theirs, attention)
            ffn = theirs + "feed_forward."
            if not self.args.is_moe_layer(layer):
                names |= {
                    f"{ours}feed_forward.{w}.weight": f"{ffn}{proj}.weight"
                    for w, proj in EXPERT_PROJECTIONS.items()
                }
                continue
            names |= {
                f"{ours}moe.shared_experts.{w}.weight": f"{ffn}shared_expert.{proj}.weight"
                for w, proj in EXPERT_PROJECTIONS.items()
            }
            names |= {
                f"{ours}moe.router.gate.weight": f"{ffn}router.weight",
                f"{ours}{_GATE_UP}": f"{ffn}experts.gate_up_proj",
                f"{ours}{_DOWN}": f"{ffn}experts.down_proj",
            }
        return names

    def _ours_for_hf(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """The routed experts fused as Hugging Face holds them; the expert bias left out."""
        fused: dict[str, Tensor] = {}
        for name, t in without_training_state(state).items():
            if name.endswith("moe.experts.w3"):
                continue
            if name.endswith("moe.experts.w1"):
                w3 = state[name[: -len("w1")] + "w3"]
                fused[name[: -len("moe.experts.w1")] + _GATE_UP] = torch.cat(
                    [t.transpose(1, 2), w3.transpose(1, 2)], dim=2
                ).contiguous()
            elif name.endswith("moe.experts.w2"):
                fused[name[: -len("moe.experts.w2")] + _DOWN] = t.transpose(1, 2).contiguous()
            else:
                fused[name] = t
        return fused

    def _hf_for_ours(self, hf_state: dict[str, Tensor]) -> dict[str, Tensor]:
        return _text_model(hf_state)

    def _ours_from_hf(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """The fused experts split back into ours, with a zero expert bias where our MoE layers keep one."""
        ours: dict[str, Tensor] = {}
        moe_blocks = []
        for name, t in state.items():
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
