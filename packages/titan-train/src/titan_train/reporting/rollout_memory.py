"""What the titan engine's rollouts hold on each rank, for the dry run: the phase the traced training step
does not cover.

Between steps, each rank keeps its parameter shards and optimizer states (the trace's `parameters` and
`optimizer state` rows); the titan engine then gathers the model (under FSDP its shards,
`rollouts.whole_weights`: every unshard at once, in FSDP's parameter dtype, and under expert parallelism only
this rank's experts, the others left on their ep ranks; under tensor parallelism an unparallelised copy,
`rollouts.WholeCopy`, in the training parameters' own float32) and allocates the KV cache of its batch
(`training.local_batch_size` completions of `grpo.max_prompt_length + max_completion_length` slots, shaped by
each attention's own cache hook, so MLA's latent and a recurrent layer's state are what they are) and the
float32 logits of one decode step. The KV cache is measured on a meta-device model, never estimated from a
formula of one family.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_models.kv_cache import KVCache
from titan_parallel import moe_layers_of
from titan_train.config.grpo_section import is_prompts
from titan_train.objectives.rollouts import decodes_on_copy
from titan_train.plan import counting_args
from titan_train.run_plan import RunPlan

KEPT_ROWS = ("parameters", "optimizer state")  # the trace's rows that stay allocated between steps


@dataclass(frozen=True)
class RolloutMemory:
    whole_weights: int
    kv_cache: int
    logits: int
    completions: int
    slots: int

    @property
    def added(self) -> int:
        return self.whole_weights + self.kv_cache + self.logits


def rollout_memory(plan: RunPlan) -> RolloutMemory:
    """The bytes the titan engine's generation adds on one rank to what training keeps between steps."""
    config = plan.config
    g, batch = config.grpo, config.training.local_batch_size
    slots = g.max_prompt_length + g.max_completion_length
    dims = plan.dims
    copy = decodes_on_copy(dims.tp)
    dtype = plan.options.data_parallel.param_dtype if dims.fsdp_enabled and not copy else torch.float32
    with torch.device("meta"):
        model = plan.family.build(counting_args(plan.model_args)).to(dtype)
    cache = KVCache.for_model(model, batch, slots)
    held = [t for layer in cache.layers for t in layer] + [cache.valid, cache.positions, cache.doc_ids]
    kv = sum(t.numel() * t.element_size() for t in held)
    experts = sum(p.numel() for moe in moe_layers_of(model).values() for p in moe.experts.parameters())
    others_experts = 0 if copy else experts - experts // dims.ep  # left on the other ep ranks
    whole = (plan.params.total - others_experts) * dtype.itemsize
    logits = batch * plan.model_args.vocab_size * 4 * 2  # float32 logits and the sampling's probabilities
    return RolloutMemory(whole, kv, logits, batch, slots)


def generates_with_titan(config) -> bool:
    """Whether the run's rollouts come from the titan engine (not vLLM, not a recorded file)."""
    g = config.grpo
    return is_prompts(config.training) and g.engine == "titan" and not g.replay_rollouts


def rollout_lines(memory: RolloutMemory, breakdown: dict[str, int], capacity: int) -> list[str]:
    """The dry run's lines for the generation phase: its peak against the device."""
    gib = 2**30
    kept = sum(breakdown.get(name, 0) for name in KEPT_ROWS)
    peak = kept + memory.added
    line = (
        f"  rollouts (titan engine), per rank: the model gathered ({memory.whole_weights / gib:.2f} GiB), "
        f"a KV cache of {memory.completions} completions x {memory.slots} slots ({memory.kv_cache / gib:.2f} GiB) "
        f"and a decode step's logits ({memory.logits / gib:.2f} GiB) beside what training keeps between steps "
        f"({kept / gib:.2f} GiB): {peak / gib:.2f} GiB"
    )
    out = [line]
    if capacity:
        over = "; over budget: fewer completions per rank (training.local_batch_size) or shorter ones"
        out.append(
            f"    {(capacity - peak) / gib:+.2f} GiB headroom during generation"
            + (over if peak > capacity else "")
        )
    return out
