"""(Titan) The [preference] section: the loss of preference tuning (`training.dataset = "preference"`).

torchtitan has no preference tuning; the names follow TRL (`DPOConfig`, `CPOConfig`, `ORPOConfig`),
whose definitions the losses equal (docs/preference.md). Rows are rendered and packed as chat rows
are, so [sft]'s packing, overlong, bad_rows and chat_template apply to them too.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from titan_train.config.fields import opt
from titan_train.config.sft_section import is_preference
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


@dataclass(frozen=True)
class PreferenceLoss:
    """`[preference]` resolved once into what its loss needs and adds: every reader of the run's preference
    settings asks this object, never `preference.loss` itself."""

    kind: str  # one of LOSSES: the pair loss `titan_train.objectives.preference_loss.pair_losses` computes
    beta: float
    label_smoothing: float
    simpo_gamma: float
    rpo_alpha: float
    reference: str  # auto, copy or precompute, as configured

    @classmethod
    def of(cls, section: Preference) -> PreferenceLoss:
        return cls(
            **{f.name: getattr(section, f.name) for f in fields(cls) if f.name != "kind"}, kind=section.loss
        )

    @property
    def needs_reference(self) -> bool:
        """Whether the loss compares the policy with reference log-probs (SimPO and ORPO do not)."""
        return self.kind not in REFERENCE_FREE

    @property
    def nll_weight(self) -> float:
        """The weight of the chosen NLL term: ORPO's own (1), else rpo_alpha (0: none)."""
        return 1.0 if self.kind == "orpo" else self.rpo_alpha

    @property
    def nll_over_whole_chosen(self) -> bool:
        """ORPO takes its NLL over the whole chosen sequence, prompt included; RPO over the completion."""
        return self.kind == "orpo"

    @property
    def reports_average_logps(self) -> bool:
        """TRL's CPO and ORPO trainers (the reference-free losses) report average, not summed, log-probs."""
        return not self.needs_reference

    def reference_source(self, lora: bool) -> str | None:
        """Where the reference log-probs come from: None (a reference-free loss), "precompute" (a table
        filled before step 1), "adapters_off" (the policy, under LoRA with reference auto) or "copy" (a
        frozen copy of the starting weights)."""
        if not self.needs_reference:
            return None
        if self.reference == "precompute":
            return "precompute"
        return "adapters_off" if lora and self.reference == "auto" else "copy"


def check_preference(config) -> None:
    """Refuse, at start and in one line, what preference tuning cannot do yet (checked with the other
    rules across fields, so `titan-train check` and dry runs see it too)."""
    p = config.preference
    loss, lora = PreferenceLoss.of(p), "lora" in config.model.converters
    if not is_preference(config.training):
        if config.validation.enable and is_preference(config.validation):
            raise ConfigError(
                "config: validation.dataset = 'preference' needs training.dataset = 'preference' (held-out "
                "pairs are scored with the preference loss); validate on the training data's kind"
            )
        return
    par = config.parallelism
    if par.context_parallel_degree > 1 and loss.reference_source(lora) == "precompute":
        raise ConfigError(
            f"config: preference.reference = 'precompute' with parallelism.context_parallel_degree = "
            f"{par.context_parallel_degree}: the table is filled by whole windows, which context parallelism "
            "deals to its ranks; set preference.reference = 'copy' (or 'auto'), or context_parallel_degree = 1"
        )
    if par.pipeline_parallel_degree > 1:
        check_pipelined_preference(config)
    if config.optimizer.early_step_in_backward:
        raise ConfigError(
            "config: optimizer.early_step_in_backward with training.dataset = 'preference' is not available; "
            "set it to false"
        )
    v = config.validation
    if v.enable and not is_preference(v):
        raise ConfigError(
            f"config: validation.dataset = {v.dataset!r} with training.dataset = 'preference': validate on "
            "held-out pairs (validation.dataset = 'preference', validation.dataset_path) or set "
            "validation.enable = false"
        )
    if v.enable and loss.reference_source(lora) == "precompute":
        raise ConfigError(
            "config: validation with preference.reference = 'precompute': the reference log-probs are "
            "precomputed for the training pairs only; set preference.reference = 'auto' or "
            "validation.enable = false"
        )
    if loss.reference_source(lora) == "adapters_off" and config.lora.train_embeddings:
        raise ConfigError(
            "config: preference.reference = 'auto' under LoRA is the base with adapters off, but "
            "lora.train_embeddings trains the embeddings in full; set preference.reference = 'copy'"
        )


def check_pipelined_preference(config) -> None:
    """Under pipeline parallelism the reference is a frozen copy with its own pipeline, or the table the
    policy's pipeline precomputes, or none: the adapters-off forward and validation run as one part only."""
    lora = "lora" in config.model.converters
    if PreferenceLoss.of(config.preference).reference_source(lora) == "adapters_off":
        raise ConfigError(
            "config: training.dataset = 'preference' with LoRA and parallelism.pipeline_parallel_degree > 1: "
            "the adapters-off reference does not run through a pipeline; set preference.reference = 'copy'"
        )
    if config.validation.enable:
        raise ConfigError(
            "config: validation of preference pairs with parallelism.pipeline_parallel_degree > 1 is not "
            "available; set validation.enable = false"
        )
