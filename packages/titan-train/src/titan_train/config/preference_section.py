"""(Titan) The [preference] section: the loss of preference tuning (`training.dataset = "preference"`).

torchtitan has no preference tuning; the names follow TRL (`DPOConfig`, `CPOConfig`, `ORPOConfig`),
whose definitions the losses equal (docs/preference.md). Rows are rendered and packed as chat rows
are, so [sft]'s packing, overlong, bad_rows and chat_template apply to them too.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_train.config.fields import opt
from titan_train.errors import ConfigError

LOSSES = ("sigmoid", "ipo", "hinge", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")


@dataclass
class Preference:
    loss: str = opt(
        "sigmoid",
        "(Titan) Preference loss as TRL defines it: sigmoid (DPO), ipo (log-probs averaged over completion "
        "tokens), hinge, simpo (length-normalised, no reference), orpo (odds ratio plus the chosen NLL, "
        "no reference)",
        choices=LOSSES,
    )
    beta: float = opt(
        0.1, "(Titan) Temperature of the implicit reward (TRL's beta; ORPO's lambda)", above=0, maximum=1e6
    )
    label_smoothing: float = opt(
        0.0,
        "(Titan) sigmoid and simpo: the chance a pair's labels are flipped (cDPO); 0 is plain DPO/SimPO",
        minimum=0,
        below=0.5,
    )
    simpo_gamma: float = opt(
        0.5, "(Titan) simpo: the target reward margin gamma (TRL's simpo_gamma)", minimum=0, maximum=1e6
    )
    rpo_alpha: float = opt(
        0.0,
        "(Titan) Weight of an NLL term on the chosen completions (RPO; TRL's loss_type ['sigmoid', 'sft'] "
        "with loss_weights [1, rpo_alpha]); 0: none. orpo always has its own NLL term",
        minimum=0,
        maximum=1e6,
    )
    reference: str = opt(
        "auto",
        "(Titan) Reference log-probs: auto (under LoRA/QLoRA the policy with its adapters switched off, else "
        "a frozen copy of the starting weights built and sharded like the policy), copy (always the frozen "
        "copy), precompute (every pair's log-probs computed once before step 1 by the starting weights, "
        "kept by pair and saved with the checkpoint: no reference model while training); simpo and orpo "
        "load none",
        choices=("auto", "copy", "precompute"),
    )


def check_preference(config) -> None:
    """Refuse, at start and in one line, what preference tuning cannot do yet (checked with the other
    rules across fields, so `titan-train check` and dry runs see it too)."""
    p = config.preference
    if config.training.dataset != "preference":
        if config.validation.enable and config.validation.dataset == "preference":
            raise ConfigError(
                "config: validation.dataset = 'preference' needs training.dataset = 'preference' (held-out "
                "pairs are scored with the preference loss); validate on the training data's kind"
            )
        return
    par = config.parallelism
    if par.context_parallel_degree > 1:
        raise ConfigError(
            f"config: training.dataset = 'preference' with parallelism.context_parallel_degree = "
            f"{par.context_parallel_degree}: preference tuning trains with data, tensor, expert and pipeline "
            "parallelism and gradient accumulation only for now; set it to 1"
        )
    if par.pipeline_parallel_degree > 1:
        check_pipelined_preference(config)
    if config.optimizer.early_step_in_backward:
        raise ConfigError(
            "config: optimizer.early_step_in_backward with training.dataset = 'preference' is not available; "
            "set it to false"
        )
    v = config.validation
    if v.enable and v.dataset != "preference":
        raise ConfigError(
            f"config: validation.dataset = {v.dataset!r} with training.dataset = 'preference': validate on "
            "held-out pairs (validation.dataset = 'preference', validation.dataset_path) or set "
            "validation.enable = false"
        )
    if v.enable and p.reference == "precompute" and p.loss not in REFERENCE_FREE:
        raise ConfigError(
            "config: validation with preference.reference = 'precompute': the reference log-probs are "
            "precomputed for the training pairs only; set preference.reference = 'auto' or "
            "validation.enable = false"
        )
    lora = "lora" in config.model.converters
    if lora and p.reference == "auto" and config.lora.train_embeddings and p.loss not in REFERENCE_FREE:
        raise ConfigError(
            "config: preference.reference = 'auto' under LoRA is the base with adapters off, but "
            "lora.train_embeddings trains the embeddings in full; set preference.reference = 'copy'"
        )


def check_pipelined_preference(config) -> None:
    """Under pipeline parallelism the reference is a frozen copy with its own pipeline, or the table the
    policy's pipeline precomputes, or none: the adapters-off forward and validation run as one part only."""
    p, lora = config.preference, "lora" in config.model.converters
    needs_reference = p.loss not in REFERENCE_FREE
    if needs_reference and lora and p.reference == "auto":
        raise ConfigError(
            "config: training.dataset = 'preference' with LoRA and parallelism.pipeline_parallel_degree > 1: "
            "the adapters-off reference does not run through a pipeline; set preference.reference = 'copy'"
        )
    if config.validation.enable:
        raise ConfigError(
            "config: validation of preference pairs with parallelism.pipeline_parallel_degree > 1 is not "
            "available; set validation.enable = false"
        )
