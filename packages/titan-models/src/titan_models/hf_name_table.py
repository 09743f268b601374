"""One base for every family's Hugging Face mapping: a name table (ours -> theirs) built once per model shape.

A family's adapter says only what differs: its table (`name_table`), the tensors whose layout changes on the
way (`_to_hf_layout`, `_from_hf_layout`), and the state it reshapes around the renaming (experts stacked or
fused, a multimodal folder's text weights, state the format cannot hold). Unwrapping, the exact key check
with its one-line error, tied embeddings and `config.json` are the same for all, so they live here once.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from torch import Tensor

from titan_models.errors import WeightMappingError

# The embedding, final norm and output head: the same names in every family.
TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Wrappers that activation checkpointing, torch.compile and FSDP insert into parameter names.
WRAPPER_PARTS = re.compile(r"(_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module)\.")
# Our stacked experts' weight names -> Hugging Face's per-expert projection names.
EXPERT_PROJECTIONS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def in_block(ours: str, theirs: str, names: Mapping[str, str]) -> dict[str, str]:
    """`names` (within a block) under the block prefixes `ours` (`"layers.3."`) and `theirs`."""
    return {ours + k: theirs + v for k, v in names.items()}


def per_expert(ours: str, theirs: str, num_experts: int) -> dict[str, str]:
    """Expert e of block `ours`'s stacked `moe.experts.w1` (named `moe.experts.w1.{e}` once unstacked,
    `titan_models.moe.expert_stacking`) -> Hugging Face's `mlp.experts.{e}.gate_proj.weight` under `theirs`."""
    return {
        f"{ours}moe.experts.{w}.{e}": f"{theirs}mlp.experts.{e}.{proj}.weight"
        for e in range(num_experts)
        for w, proj in EXPERT_PROJECTIONS.items()
    }


class NameTableAdapter:
    """Converts full (unsharded) state dicts to and from a Hugging Face class's, for one model shape.

    A subclass gives `name_table()` and `to_hf_config`, and overrides a hook only where its family needs one.
    With tied embeddings the output head is the embedding matrix: `to_hf` leaves out `lm_head.weight`, as
    Hugging Face's saved files do, and `from_hf` restores `output.weight`.
    """

    # The model as the mapping error names it ("this gpt-oss model").
    model_name: ClassVar[str] = "model"
    # The family's `config.json` writer, `(args, bos_id=, eos_id=) -> dict` (a staticmethod).
    to_hf_config: ClassVar[Callable[..., dict]]

    def __init__(self, args: Any, *, bos_id: int | None = None, eos_id: int | None = None):
        self.args = args
        self.bos_id, self.eos_id = bos_id, eos_id
        self._to_hf_names = self.name_table()
        self._from_hf_names = {theirs: ours for ours, theirs in self._to_hf_names.items()}

    def name_table(self) -> dict[str, str]:
        """Every tensor's name, ours -> Hugging Face's, for this model shape."""
        raise NotImplementedError

    # Hooks (identity unless a family says otherwise).
    def _ours_for_hf(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """Our unwrapped state as the table names it (experts unstacked, training state left out)."""
        return state

    def _to_hf_layout(self, name: str, tensor: Tensor) -> Tensor:
        """Our tensor `name` in Hugging Face's layout."""
        return tensor

    def _hf_copies(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """Hugging Face tensors written as copies of ours, outside the table."""
        return {}

    def _hf_for_ours(self, hf_state: dict[str, Tensor]) -> dict[str, Tensor]:
        """A checkpoint's state as the table names it (a multimodal folder's text weights, skipped layers)."""
        return hf_state

    def _from_hf_layout(self, name: str, tensor: Tensor) -> Tensor:
        """Hugging Face's tensor for our `name` in our layout."""
        return tensor

    def _ours_from_hf(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """Renamed state as the model holds it (experts stacked, a zero expert bias)."""
        return state

    def _shape(self) -> str:
        """The model shape the mapping error names."""
        return f"{self.args.n_layers} layers, tie_word_embeddings={self.args.tie_word_embeddings}"

    def _checked(self, state: dict[str, Tensor], names: dict[str, str], head: str, kind: str) -> dict:
        """A copy of `state` without a tied output head (`head`), once its keys are exactly `names`."""
        state = dict(state)
        expected = set(names)
        if self.args.tie_word_embeddings:
            state.pop(head, None)
            expected.discard(head)
        missing, unknown = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or unknown:
            raise WeightMappingError(
                f"model: the {kind} state dict does not fit this {self.model_name} ({self._shape()}): "
                f"missing {missing[:5]}, unexpected {unknown[:5]}; check the model flavor against the checkpoint"
            )
        return state

    def to_hf(self, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        """Our names and layout -> Hugging Face's."""
        state = self._ours_for_hf({WRAPPER_PARTS.sub("", name): t for name, t in state_dict.items()})
        checked = self._checked(state, self._to_hf_names, "output.weight", "Titan")
        hf = {self._to_hf_names[name]: self._to_hf_layout(name, t) for name, t in checked.items()}
        return hf | self._hf_copies(state)

    def from_hf(self, hf_state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        """Hugging Face's names and layout -> ours (what the model's `load_state_dict` takes)."""
        hf = self._checked(
            self._hf_for_ours(hf_state_dict), self._from_hf_names, "lm_head.weight", "Hugging Face"
        )
        ours = {}
        for name, tensor in hf.items():
            our_name = self._from_hf_names[name]
            ours[our_name] = self._from_hf_layout(our_name, tensor)
        if self.args.tie_word_embeddings:
            ours["output.weight"] = ours["tok_embeddings.weight"]
        return self._ours_from_hf(ours)

    def hf_config(self) -> dict:
        """The `config.json` of the equivalent Hugging Face model (the family's `to_hf_config`)."""
        return self.to_hf_config(self.args, bos_id=self.bos_id, eos_id=self.eos_id)
