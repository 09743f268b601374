"""The longest sequence a model flavor is meant for, the refusal of a seq_len beyond it, and the length
the model is built for.

The trainer sizes the rotary table to the longest sequence the run feeds the model (`model_seq_len`),
so nothing would fail: a model would train on positions its flavor was never built for (and a typo such
as 81920 for 8192 would exhaust memory deep inside attention). The limit is the flavor's `context_len`
(for the rope-scaled Llama 3 flavors, the 128K context their rope scaling was published for).
"""

from __future__ import annotations

from titan_models import ModelArgs
from titan_train.config import JobConfig
from titan_train.errors import ConfigError
from titan_train.wiring.hf_interop import model_args


def context_limit(args: ModelArgs) -> int:
    """Tokens per sequence a flavor supports."""
    return args.context_len


def check_seq_len(config: JobConfig) -> None:
    """Refuse a training (or validation) seq_len beyond the model's context, naming the limit and the fix."""
    m = config.model
    limit = context_limit(model_args(config))
    lengths = [("training.seq_len", config.training.seq_len)]
    if config.validation.enable:
        lengths.append(("validation.seq_len", config.validation.seq_len))
    for name, value in lengths:
        if value > limit:
            raise ConfigError(
                f"config: {name} = {value} is beyond the {limit}-token context of {m.name} {m.flavor}; "
                f"set {name} to at most {limit}, or pick a model.flavor with a longer context"
            )


def model_seq_len(config: JobConfig) -> int:
    """Positions the model is built for: the longer of training.seq_len and, when validation runs,
    validation.seq_len (FLOPs and memory still count training.seq_len)."""
    if config.validation.enable:
        return max(config.training.seq_len, config.validation.seq_len)
    return config.training.seq_len
