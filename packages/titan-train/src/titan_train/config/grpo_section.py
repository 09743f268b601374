"""(Titan) The [grpo] section: learning from rewards on prompt-only rows (`training.dataset = "prompts"`).

torchtitan 0.2.2 has no online RL; the names and defaults follow TRL 1.16's `GRPOConfig`, whose
definitions the losses equal (titan_train.objectives.grpo_loss). A step's micro-batch holds
`training.local_batch_size` completions per data-parallel rank: `local_batch_size / num_generations`
prompts, each continued `num_generations` times (TRL's per_device_train_batch_size and generation batch,
with steps_per_generation = the gradient accumulation steps).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from titan_data import PROMPTS
from titan_train.config.converters import LORA
from titan_train.config.fields import opt
from titan_train.config.sft_section import FIELD_NAME
from titan_train.errors import ConfigError

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo")
ENGINES = ("titan", "vllm")
TEXT_PROMPTS = ("raw", "user_turn")
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
VLLM_INSTALL = "uv sync --project apps/vllm --locked"


def is_prompts(section: Any) -> bool:
    """Whether a `[training]` or `[validation]` section reads prompt-only rows: the one place that says so."""
    return section.dataset == PROMPTS


@dataclass
class GRPO:
    num_generations: int = opt(
        8, "(Titan) Completions sampled per prompt: a group, whose rewards set each other's advantage",
        minimum=2, maximum=4096,
    )  # fmt: skip
    prompt_field: str = opt(
        "prompt", "(Titan) Column holding a row's prompt (TRL's layout: prompt; GSM8K: question)",
        pattern=FIELD_NAME,
    )  # fmt: skip
    text_prompts: str = opt(
        "raw",
        "(Titan) A plain-text prompt is tokenised as it is (raw, TRL's way) or framed as a user turn and "
        "rendered by the chat template with its generation prompt (user_turn: a chat model on a text dataset)",
        choices=TEXT_PROMPTS,
    )
    system_prompt: str = opt(
        "",
        "(Titan) A system turn put first in every conversational prompt that has none (plain text needs "
        "text_prompts = user_turn); empty: none",
    )
    max_prompt_length: int = opt(
        512, "(Titan) Longest prompt in tokens (chat template and generation prompt included)", minimum=1,
        maximum=1 << 20,
    )  # fmt: skip
    overlong_prompts: str = opt(
        "truncate",
        "(Titan) A longer prompt keeps its last max_prompt_length tokens (truncate) or is left out (drop); "
        "either is counted in the log",
        choices=("truncate", "drop"),
    )
    max_completion_length: int = opt(
        512, "(Titan) Most tokens generated per completion (TRL's max_completion_length)", minimum=1,
        maximum=1 << 20,
    )  # fmt: skip
    temperature: float = opt(
        1.0, "(Titan) Sampling temperature; the trained log-probs use the same scaled logits, as TRL's do",
        above=0, maximum=100,
    )  # fmt: skip
    top_p: float = opt(1.0, "(Titan) Nucleus sampling mass; 1: off", above=0, maximum=1)
    top_k: int = opt(0, "(Titan) Sample among the k most likely tokens; 0: off", minimum=0, maximum=1 << 20)
    engine: str = opt(
        "titan",
        "(Titan) What generates the rollouts: titan (the policy's own KV-cache generator, in the training "
        "processes) or vllm (a vLLM server in its own environment, apps/vllm, sent the policy's weights before "
        "each generation)",
        choices=ENGINES,
    )
    vllm_url: str | None = opt(
        None,
        "(Titan) With engine vllm: the URL of a running rollout server (apps/vllm/serve.py); unset: the run "
        "starts one from grpo.vllm_project and stops it at exit",
        pattern=(r"https?://[^\s/]+(:\d+)?/?", "http://HOST:PORT"),
    )
    vllm_project: str = opt(
        "apps/vllm",
        "(Titan) With engine vllm and no vllm_url: the uv project whose .venv runs serve.py (install: "
        f"{VLLM_INSTALL})",
        nonempty=True,
    )
    vllm_server_timeout: float = opt(
        240.0,
        "With engine vllm: seconds the run waits for a server that stopped answering to answer again (TRL's "
        "name); a server the run started is restarted at once on the weights it held. Then the run stops in "
        "one line, keeping its checkpoints",
        above=0,
        maximum=86_400.0,
    )
    vllm_gpu_memory_utilization: float = opt(
        0.15,
        "(Titan) With engine vllm and no vllm_url: vLLM's gpu_memory_utilization, the share of the device's "
        "memory for its KV cache (of host memory on the CPU build)",
        above=0,
        maximum=1,
    )
    vllm_importance_sampling_correction: bool = opt(
        True,
        "(Titan) With engine vllm: weigh each token's loss by the truncated or masked ratio of the trainer's "
        "to vLLM's probability of it (TRL's vllm_importance_sampling_correction)",
    )
    vllm_importance_sampling_mode: str = opt(
        "sequence_mask",
        "(Titan) How that ratio is taken: per token or per sequence (the product), clipped to [clip_min, "
        "clip_max] (truncate) or zeroed outside it (mask); TRL's modes and default",
        choices=IS_MODES,
    )
    vllm_importance_sampling_clip_max: float = opt(
        3.0, "(Titan) Upper bound C_max of the ratio (TRL's vllm_importance_sampling_clip_max)", above=0,
        maximum=1e6,
    )  # fmt: skip
    vllm_importance_sampling_clip_min: float = opt(
        0.0, "(Titan) Lower bound C_min of the ratio; 0: none (TRL's None)", minimum=0, maximum=1e6
    )
    replay_rollouts: str | None = opt(
        None,
        "(Titan) Train on the completions recorded in this rollouts file or folder (what a run writes under "
        "dump_folder/rollouts) instead of generating: a step's prompts must be those recorded for it",
        path="a rollouts .jsonl file or a folder of them",
    )
    reward_funcs: list[str] = opt(
        [],
        "(Titan) Reward functions, each a built-in (answer_match, think_format) or 'module:function' with "
        "TRL's signature (prompts, completions, completion_ids, the row's other columns as keywords)",
        pattern=(r"[A-Za-z_][\w.]*(:[A-Za-z_]\w*)?", "a built-in name or module:function"),
    )
    reward_weights: list[float] = opt(
        [], "(Titan) Weight of each reward function in the sum; empty: 1 each", minimum=-1e6, maximum=1e6
    )
    scale_rewards: str = opt(
        "group",
        "(Titan) Advantages divided by the std of the group's rewards (group), of the whole batch's (batch), "
        "or not (none: Dr. GRPO)",
        choices=("group", "batch", "none"),
    )
    loss_type: str = opt(
        "dapo",
        "(Titan) Policy loss as TRL defines it: grpo (mean per completion), bnpo (per token of the "
        "micro-batch), dr_grpo (per completion x max_completion_length), dapo (per token of the generation "
        "batch), cispo (clipped importance-sampling weights), sapo (soft gates)",
        choices=LOSS_TYPES,
    )
    beta: float = opt(
        0.0,
        "(Titan) Weight of the KL to the reference (k3 estimate); 0: no reference",
        minimum=0,
        maximum=1e6,
    )
    epsilon: float = opt(0.2, "(Titan) Lower clipping range of the ratio", above=0, below=1)
    epsilon_high: float = opt(
        0.0, "(Titan) Upper clipping range (DAPO's clip-higher); 0: epsilon", above=0, maximum=1e6,
        sentinels=(0.0,),
    )  # fmt: skip
    delta: float = opt(
        0.0, "(Titan) Cap on the ratio before clipping (two-sided GRPO); 0: off", above=1, maximum=1e6,
        sentinels=(0.0,),
    )  # fmt: skip
    importance_sampling_level: str = opt(
        "token",
        "(Titan) One ratio per token, or per sequence from the mean log-ratio (sequence: GSPO)",
        choices=("token", "sequence"),
    )
    use_bias_correction_kl: bool = opt(
        True, "(Titan) The KL term weighted by the importance ratio, as TRL's default does"
    )
    mask_truncated_completions: bool = opt(
        False, "(Titan) Completions that reached max_completion_length without ending count in no loss"
    )
    num_iterations: int = opt(
        1,
        "(Titan) Optimizer steps per generation batch (TRL's mu): after the first, the ratio to the generating "
        "policy's log-probs leaves 1 and clips",
        minimum=1,
        maximum=1024,
    )
    max_staleness: int = opt(
        0,
        "(Titan) Optimizer steps between the weights that generate a batch and the weights that train on it: "
        "0 on-policy; 1 one step off-policy (step t trains what the weights before step t - 1 generated, "
        "their log-probs the old ones; vllm generates while the step trains)",
        minimum=0,
        maximum=1,
    )
    sapo_temperature_pos: float = opt(
        1.0, "(Titan) sapo: gate temperature for positive advantages", above=0, maximum=1e3
    )
    sapo_temperature_neg: float = opt(
        1.05, "(Titan) sapo: gate temperature for negative advantages", above=0, maximum=1e3
    )
    reference: str = opt(
        "auto",
        "(Titan) With beta > 0, the KL reference: auto (under LoRA/QLoRA the policy with its adapters off, else "
        "a frozen copy of the starting weights sharded like the policy) or copy (always the frozen copy)",
        choices=("auto", "copy"),
    )


def _changed(section: GRPO) -> list[str]:
    defaults = GRPO()
    return [
        f"grpo.{f.name}" for f in fields(section) if getattr(section, f.name) != getattr(defaults, f.name)
    ]


def check_grpo(config) -> None:
    """Refuse, at start and in one line, what learning from rewards cannot do (yet), and [grpo] set for a run
    that does not read prompts."""
    g, t, par = config.grpo, config.training, config.parallelism
    if not is_prompts(t):
        changed = _changed(g)
        if changed:
            raise ConfigError(
                f"config: {', '.join(changed)} set, but training.dataset is {t.dataset!r}: [grpo] applies to "
                "training.dataset = 'prompts'; remove them or train on prompts"
            )
        if is_prompts(config.validation) and config.validation.enable:
            raise ConfigError("config: validation.dataset = 'prompts' needs training.dataset = 'prompts'")
        return
    if not g.reward_funcs:
        raise ConfigError(
            "config: training.dataset = 'prompts' needs grpo.reward_funcs: built-ins (answer_match, "
            "think_format) or 'module:function' names"
        )
    if g.reward_weights and len(g.reward_weights) != len(g.reward_funcs):
        raise ConfigError(
            f"config: grpo.reward_weights has {len(g.reward_weights)} values for {len(g.reward_funcs)} "
            "grpo.reward_funcs; give one weight per function, or none"
        )
    if t.local_batch_size % g.num_generations:
        raise ConfigError(
            f"config: training.local_batch_size ({t.local_batch_size}) counts completions and must be a multiple "
            f"of grpo.num_generations ({g.num_generations}), so that each rank holds whole groups"
        )
    if t.seq_len < g.max_prompt_length + g.max_completion_length:
        raise ConfigError(
            f"config: training.seq_len ({t.seq_len}) must hold a prompt and its completion: at least "
            f"grpo.max_prompt_length + grpo.max_completion_length = {g.max_prompt_length + g.max_completion_length}"
        )
    refusals = [
        (
            g.engine == "vllm" and LORA in config.model.converters,
            "grpo.engine = 'vllm' and LoRA (the weight push sends whole Hugging Face exports, not adapters)",
            "set grpo.engine = 'titan'",
        ),
        (
            g.num_iterations > 1 and t.dataloader.num_streams != 0,
            "grpo.num_iterations > 1 and training.dataloader.num_streams (a generation batch repeats per rank)",
            "leave num_streams at 0 (one stream per data-parallel rank)",
        ),
        (
            par.pipeline_parallel_degree > 1,
            "parallelism.pipeline_parallel_degree > 1 (the GRPO step takes every completion token's log-prob "
            "from one whole model part, not through a pipeline schedule's last stage, and the titan engine "
            "generates on whole models)",
            "set it to 1; shard the model with data_parallel_shard_degree, tensor or expert parallelism",
        ),
        (
            par.context_parallel_degree > 1,
            "parallelism.context_parallel_degree > 1 (generation does not split sequences)",
            "set it to 1",
        ),
        (
            g.max_staleness > 0 and g.num_iterations > 1,
            "grpo.max_staleness = 1 and grpo.num_iterations > 1 (a reused batch's old log-probs are its own "
            "generation's, whose lag the reuse already sets)",
            "set one of them back to its default",
        ),
        (
            g.max_staleness > 0 and bool(g.replay_rollouts),
            "grpo.max_staleness = 1 and grpo.replay_rollouts (replayed rollouts were generated by another run's "
            "weights: nothing is generated ahead)",
            "set grpo.max_staleness = 0",
        ),
        (config.optimizer.early_step_in_backward, "optimizer.early_step_in_backward", "set it to false"),
        (config.validation.enable, "validation", "set validation.enable = false"),
        (bool(t.epochs), "training.epochs", "set training.steps"),
        (bool(t.dataset_mixture), "training.dataset_mixture", "give one training.dataset_path"),
        (config.compile.enable, "compile.enable (generation's shapes change every token)", "set it to false"),
    ]
    for hit, what, fix in refusals:
        if hit:
            raise ConfigError(f"config: training.dataset = 'prompts' with {what}: {fix}")
    _check_vllm(g)


def _check_vllm(g: GRPO) -> None:
    """The vllm_* fields apply to the vllm engine, the start settings only where the run starts the server,
    and the engine needs its environment installed (or a server's URL)."""
    changed = [name for name in _changed(g) if name.startswith("grpo.vllm_")]
    if g.engine != "vllm" and changed:
        raise ConfigError(
            f"config: {', '.join(changed)} set, but grpo.engine is {g.engine!r}: they apply to "
            "grpo.engine = 'vllm'; remove them or set the engine"
        )
    if g.engine != "vllm":
        return
    if g.vllm_url is not None:
        starting = [n for n in changed if n in ("grpo.vllm_project", "grpo.vllm_gpu_memory_utilization")]
        if starting:
            raise ConfigError(
                f"config: {', '.join(starting)} set with grpo.vllm_url: they apply to a server the run starts; "
                "give them to the server at the URL, or unset grpo.vllm_url"
            )
        return
    project = Path(g.vllm_project)
    if not (project / "serve.py").is_file() or not (project / ".venv" / "bin" / "python").is_file():
        raise ConfigError(
            f"config: grpo.engine = 'vllm' needs the vLLM environment in grpo.vllm_project = {str(project)!r} "
            f"(serve.py and .venv/bin/python): install it with `{VLLM_INSTALL}` from the repository root, or "
            "give grpo.vllm_url"
        )
