"""Parameter names as the model spells them, without the wrappers the parallelisms insert.

Activation checkpointing (`_checkpoint_wrapped_module.`), torch.compile (`_orig_mod.`) and FSDP's module
wrappers (`_fsdp_wrapped_module.`) put a part into a parameter's name; checkpoints, weight mappings and
adapters' seeds name parameters without them. This is the one list of them.
"""

from __future__ import annotations

import re

WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
_WRAPPERS = re.compile("|".join(re.escape(prefix) for prefix in WRAPPER_PREFIXES))


def plain_name(name: str) -> str:
    """`name` without the parts that activation checkpointing, compile and FSDP insert."""
    return _WRAPPERS.sub("", name)
