"""Learning from rewards (GRPO and its family, as TRL 1.16's GRPOTrainer computes them) as the run's objective.

Per optimizer step: the step's prompts (the loader's micro-batches) are continued `num_generations` times
each (`titan_train.objectives.rollouts`), the reward functions score every completion, advantages come from
each group's rewards over all data-parallel ranks (`grpo_loss.group_advantages`), and the step trains on the
completions, one micro-batch of `training.local_batch_size` of them per micro-batch of prompts. With one
optimizer step per generation the policy is its own old policy (the ratio is 1); with `num_iterations` = mu
> 1 the generating policy's log-probs are kept as the old ones and the next mu - 1 steps train on the same
rollouts (the data repeats the step's prompts, see titan_data.prompts.dataset), saved with the checkpoint
so a resume between them trains on what was generated. The reference, with beta > 0, is a frozen copy of
the starting weights or the base with adapters off, as preference tuning's.
"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

from titan_ckpt import ModelState
from titan_data.chat.prompt import end_of_turn_id
from titan_data.errors import DataError
from titan_models.generation import SamplingParams
from titan_parallel import adapters_off
from titan_train.objectives.forward import model_forward, whole_sequence_context
from titan_train.objectives.grpo_loss import GRPOLoss, group_advantages
from titan_train.objectives.off_policy import Background, steps_of_batches
from titan_train.objectives.preference_step import build_reference, copy_starting_weights, evaluating
from titan_train.objectives.protocol import Batch, ObjectiveContext
from titan_train.objectives.reward_table import RewardScorer
from titan_train.objectives.rollouts import (
    Completions,
    RecordedRollouts,
    RolloutLog,
    WholeCopy,
    check_same_over,
    completion_seeds,
    decodes_on_copy,
    generating_model,
    generation_eos_ids,
    lockstep,
    titan_completions,
)
from titan_train.objectives.sampling_correction import SamplingCorrection
from titan_train.objectives.vllm_engine import VLLMEngine, sampling_tensor
from titan_train.wiring.data import chat_template
from titan_train.wiring.lora import lora_enabled
from titan_train.wiring.valid_token_loss import IGNORE_INDEX


def loss_settings(g) -> GRPOLoss:
    """`[grpo]` as the loss's settings (0 for epsilon_high and delta: TRL's None)."""
    return GRPOLoss(
        loss_type=g.loss_type,
        beta=g.beta,
        epsilon=g.epsilon,
        epsilon_high=g.epsilon_high or None,
        delta=g.delta or None,
        importance_sampling=g.importance_sampling_level,
        kl_importance_correction=g.use_bias_correction_kl,
        max_completion_length=g.max_completion_length,
        sapo_temperature_pos=g.sapo_temperature_pos,
        sapo_temperature_neg=g.sapo_temperature_neg,
    )


def token_logps(logits: torch.Tensor, labels: torch.Tensor, temperature: float):
    """(B, T) log-probs of the labels and entropies, from logits scaled by the sampling temperature (0 where
    a label is ignored). Under TP with loss parallelism (inside its context) the logits are a DTensor sharded
    over the vocabulary: the pick is the sharded cross-entropy's, the entropy's sum over the vocabulary a
    partial sum the ranks add; both come back replicated, as plain tensors."""
    valid = labels != IGNORE_INDEX
    scaled = logits.float() / temperature
    if not isinstance(scaled, DTensor):
        logp = F.log_softmax(scaled, dim=-1)
        picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1)
        return torch.where(valid, picked, 0.0), torch.where(valid, entropy, 0.0)
    flat = scaled.reshape(-1, scaled.shape[-1])
    mesh = flat.device_mesh
    target = DTensor.from_local(labels.clamp(min=0).reshape(-1), mesh, [Replicate()] * mesh.ndim)
    picked = -F.cross_entropy(flat, target, reduction="none").full_tensor().view(labels.shape)
    with torch.no_grad():
        logp = F.log_softmax(flat, dim=-1)
        entropy = (-(logp.exp() * logp)).sum(-1).full_tensor().view(labels.shape)
    return torch.where(valid, picked, 0.0), torch.where(valid, entropy, 0.0)


def _indices(step_batches: list[Batch]) -> list[int]:
    """The prompts' indices of a step's prompt batches (the data's third row)."""
    return [int(i) for batch in step_batches for i in batch[2][:, 0].tolist()]


@dataclass
class _Micro:
    """What one training micro-batch needs beside its tokens."""

    advantages: torch.Tensor  # (B,)
    mask: torch.Tensor  # (B, T) float: the completion tokens that count in the loss
    ref_logps: torch.Tensor | None
    old_logps: torch.Tensor | None = None  # the generating policy's, with num_iterations > 1
    sampling_logps: torch.Tensor | None = None  # (B, T) the engine's, where it reports them (vllm)


class RolloutCache:
    """A generation batch kept for later steps (the steps that reuse it with num_iterations > 1, or the
    next step one step off-policy): the prompts' indices, the training micro-batches and what each needs,
    and the batch's completion-token count; saved per rank."""

    def __init__(self, rank: int, device: torch.device, name: str = "rollouts"):
        self.key, self.device = f"{name}_rank{rank}", device
        self.held: dict | None = None

    def state_dict(self) -> dict:
        buffer = io.BytesIO()
        if self.held is not None:
            torch.save(self.held, buffer)
        return {self.key: buffer.getvalue()}

    def load_state_dict(self, state: dict) -> None:
        data = state.get(self.key, b"")
        self.held = None
        if data:
            self.held = torch.load(io.BytesIO(data), map_location=self.device, weights_only=False)


class GRPO:
    """Prompts in, rollouts scored and trained on; TRL's reward, kl, entropy, clip and length metrics out."""

    def __init__(self, ctx: ObjectiveContext):
        self.ctx, self.plan = ctx, ctx.plan
        config = ctx.plan.config
        g = self.settings = config.grpo
        self.loss = loss_settings(g)
        self.scorer = RewardScorer(g, ctx.tokenizer)
        source = None
        if self.loss.needs_reference:
            source = "adapters_off" if lora_enabled(config) and g.reference == "auto" else "copy"
        self.source = source
        self.reference_parts = build_reference(source, lambda: ctx.build_copy().parts)
        dp = ctx.plan.dims.submesh("dp")
        self.dp_group = dp.get_group() if dp is not None else None
        self.dp_rank, self.dp_degree = (dp.get_local_rank(), dp.size()) if dp is not None else (0, 1)
        self.tokenizer = ctx.tokenizer
        self.ends = self._end_ids(config)
        self.replay = RecordedRollouts(g.replay_rollouts) if g.replay_rollouts else None
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.log = RolloutLog(Path(config.job.dump_folder), rank)
        self.engine = None
        if g.engine == "vllm" and self.replay is None:
            self.engine = VLLMEngine(ctx.plan, ctx.tokenizer, Path(config.job.dump_folder))
        tp = ctx.plan.dims.submesh("tp")
        self.tp_group = tp.get_group() if tp is not None else None
        generates = g.engine == "titan" and self.replay is None
        self.copy = self._whole_copy() if generates else None
        # Under EP the experts' all-to-alls and FSDP gathers run in every decode step: the ranks step together.
        together = generates and self.copy is None and ctx.plan.dims.ep > 1
        self.all_done = lockstep(dist.group.WORLD, ctx.device) if together else None
        self.step_number, self.loader = 0, ctx.loader
        self.cache = RolloutCache(rank, ctx.device) if g.num_iterations > 1 else None
        # One step off-policy: the batch generated for the next step, and vllm's request for it in flight.
        self.pending = RolloutCache(rank, ctx.device, "pending") if g.max_staleness else None
        self.requested: tuple[list[int], Background] | None = None
        self.wanted, self.lag = 1, 0
        self.micro: list[_Micro] = []
        self.metrics: dict[str, float] = {}

    def _whole_copy(self) -> WholeCopy | None:
        """Under tensor parallelism, the unparallelised model the titan engine fills and decodes on."""
        if not decodes_on_copy(self.plan.dims.tp):
            return None  # FSDP, DDP and EP: the policy's own modules, its shards gathered (whole_weights)
        return WholeCopy(self.ctx.build_whole)

    def _end_ids(self, config) -> set[int]:
        """Where a completion ends: the model's generation config's EOS ids, the tokenizer's EOS and the chat
        template's end-of-turn id."""
        ends = {self.tokenizer.eos_id, *generation_eos_ids(config.model.hf_assets_path)}
        try:
            ends.add(end_of_turn_id(chat_template(config), self.tokenizer))
        except DataError:
            pass  # no chat template: plain-text prompts end at EOS
        return ends

    def states(self) -> dict:
        states = {"reference": ModelState(self.reference_parts)} if self.reference_parts else {}
        states.update({"grpo_rollouts": self.cache} if self.cache is not None else {})
        return {**states, **({"grpo_pending": self.pending} if self.pending is not None else {})}

    def start(self, step: int, loader) -> None:
        self.step_number, self.loader = step, loader
        self.log.resume_from(step)
        if step == 0 and self.reference_parts is not None:
            copy_starting_weights(self.reference_parts, self.ctx.parts)

    # -- a step's rollouts --------------------------------------------------------------------------------

    def _params(self, step: int, indices: list[int]) -> SamplingParams:
        g = self.settings
        return SamplingParams(
            max_new_tokens=g.max_completion_length,
            temperature=g.temperature,
            top_k=g.top_k,
            top_p=g.top_p,
            row_seeds=completion_seeds(self.plan.seed, step, indices, g.num_generations),
            eos_ids=tuple(sorted(self.ends)),
        )

    def _complete(self, indices: list[int], prompts: list[list[int]], step: int) -> Completions:
        """Step `step`'s completions of its prompts, on the current weights (after step_number - 1 steps)."""
        g = self.settings
        if self.replay is not None:
            return self.replay.completions(step, indices, prompts, g.num_generations, self.ends)
        params, parts = self._params(step, indices), self.ctx.parts
        if self.engine is not None:
            return self.engine.completions(parts, self.step_number - 1, prompts, g.num_generations, params)
        with torch.no_grad(), evaluating(parts), generating_model(parts, self.copy) as model:
            completions = titan_completions(
                model, prompts, g.num_generations, params, self.tokenizer.eos_id, self.all_done
            )
        check_same_over(completions, self.tp_group, self.ctx.device)
        return completions

    def _gather(self, local: torch.Tensor) -> torch.Tensor:
        """Every data-parallel rank's rows, in rank order (each rank holds the same number)."""
        if self.dp_group is None:
            return local
        out = [torch.empty_like(local) for _ in range(self.dp_degree)]
        dist.all_gather(out, local.contiguous(), group=self.dp_group)
        return torch.cat(out)

    def _lengths(self, completions: Completions) -> torch.Tensor:
        """(B_all, 2) every data-parallel rank's completion lengths and truncated flags, in rank order."""
        local = torch.tensor(
            [[len(c), float(t)] for c, t in zip(completions.ids, completions.truncated, strict=True)],
            dtype=torch.float64,
            device=self.ctx.device,
        )
        return self._gather(local).cpu()

    def steps_of_batches(self, step: int) -> int:
        """How many steps' prompts step `step` takes (`TakesBatchesAhead`): one on-policy; one step
        off-policy, its own unless a batch is held for it, and the next step's unless it is the last."""
        held = (
            self.pending is not None and self.pending.held is not None and self.pending.held["step"] == step
        )
        self.wanted = steps_of_batches(self.settings.max_staleness, held, step, self.plan.steps)
        return self.wanted

    def begin_step(self, step_batches: list[Batch]) -> list[Batch]:
        """The step's rollouts from its prompts, scored, as the micro-batches it trains on."""
        self.step_number += 1
        self.step_started, self.training_started, self.ahead_times = time.perf_counter(), None, None
        g, device = self.settings, self.ctx.device
        # kl, tokens, entropy, low, high and region clips, their count, |logp - old logp| sum
        self.sums = torch.zeros(8, dtype=torch.float64, device=device)
        self.correction = SamplingCorrection(g, self.dp_group, device)
        if self.pending is not None:
            return self._off_policy_step(step_batches)
        indices = _indices(step_batches)
        if (self.step_number - 1) % g.num_iterations:
            return self._reuse(indices)
        held = self._generation(indices, self.step_number)
        if self.cache is not None:
            self._keep_old_logps(held)
            self.cache.held = held
        return self._use(held)

    def _off_policy_step(self, step_batches: list[Batch]) -> list[Batch]:
        """One step off-policy (see titan_train.objectives.off_policy): train the batch held for this step
        (or, holding none, this step's own, on-policy) and generate the next step's on these weights."""
        step, held = self.step_number, self.pending.held
        per_step = len(step_batches) // max(self.wanted, 1)
        if held is None or held["step"] != step:
            held, step_batches = (
                self._generation(_indices(step_batches[:per_step]), step),
                step_batches[per_step:],
            )
        self.pending.held = None
        if step_batches:
            indices, started = _indices(step_batches), time.perf_counter()
            if self.engine is None:
                self.pending.held = self._generation(indices, step + 1)
                self._keep_old_logps(self.pending.held)
                self.ahead_times = (started, time.perf_counter(), None)
            else:
                prompts = [self.loader.packed.prompts[i].ids.tolist() for i in indices]
                params, n = self._params(step + 1, indices), self.settings.num_generations
                self.requested = indices, self.engine.request(self.ctx.parts, step - 1, prompts, n, params)
        return self._use(held)

    def _join_request(self) -> None:
        """vllm one step off-policy: the next step's completions, awaited after this step trained, scored
        and held with the log-probs vLLM sampled them at as the old ones."""
        indices, request = self.requested
        self.requested = None
        joined = time.perf_counter()
        completions = request.result()
        self.ahead_times = (request.started, request.ended, joined)
        held = self._process(indices, completions, self.step_number + 1, request.ended - request.started)
        for micro in held["micro"]:
            micro.old_logps, micro.sampling_logps = micro.sampling_logps, None
        self.pending.held = held

    def _generation(self, indices: list[int], step: int) -> dict:
        """Step `step`'s prompts continued on the current weights, scored, as what training on them needs."""
        prompts = [self.loader.packed.prompts[i].ids.tolist() for i in indices]
        started = time.perf_counter()
        completions = self._complete(indices, prompts, step)
        return self._process(indices, completions, step, time.perf_counter() - started)

    def _process(self, indices: list[int], completions: Completions, step: int, generated: float) -> dict:
        """Completions scored (rewards over every data-parallel rank, advantages) and laid out as training
        micro-batches; nothing of the objective's state changes (a batch may be held for the next step)."""
        g, device = self.settings, self.ctx.device
        rows = [self.loader.packed.prompts[i] for i in indices]
        prompts = [row.ids.tolist() for row in rows]
        started = time.perf_counter()
        table = self.scorer.score(rows, completions, step)
        rewards_seconds = time.perf_counter() - started
        everyone = self._gather(table.to(device)).cpu()
        advantages, _ = group_advantages(everyone, self.scorer.weights, g.num_generations, g.scale_rewards)
        mine = len(completions.ids)
        advantages = advantages[self.dp_rank * mine : (self.dp_rank + 1) * mine].float()
        metrics = self.scorer.metrics(everyone, self._lengths(completions))
        new_tokens = sum(len(c) for c in completions.ids)
        metrics.update(
            {
                "rollout_tps": new_tokens / generated if generated > 0 and self.replay is None else 0.0,
                "time/generation_s": generated,
                "time/rewards_s": rewards_seconds,
            }
        )
        if self.engine is not None:
            metrics["time/weight_sync_s"] = self.engine.push_seconds
        micro, batches = self._training_batches(prompts, completions, advantages)
        tokens = torch.tensor(float(sum(m.mask.sum().item() for m in micro)), device=device)
        if self.dp_group is not None:
            dist.all_reduce(tokens, group=self.dp_group)
        return {
            "step": step,
            "version": self.step_number - 1,  # the optimizer steps behind the generating weights
            "indices": indices,
            "prompts": prompts,
            "completions": completions,
            "table": table,
            "micro": micro,
            "batches": batches,
            "tokens_in_batch": tokens.item(),
            "metrics": metrics,
        }

    def _use(self, held: dict) -> list[Batch]:
        """Train this step on `held`: its micro-batches, its metrics, its lines in the rollout log."""
        self.micro, self.tokens_in_batch, self.metrics = (
            held["micro"],
            held["tokens_in_batch"],
            held["metrics"],
        )
        self.lag = self.step_number - 1 - held["version"]
        self._write_log(held["indices"], held["prompts"], held["completions"], held["table"])
        return held["batches"]

    def _keep_old_logps(self, held: dict) -> None:
        """The generating policy's log-probs of its completions, before any step moves it."""
        parts = self.ctx.parts
        with torch.no_grad(), evaluating(parts), whole_sequence_context(self.plan, self.ctx.forward_context):
            for (inputs, labels, _), micro in zip(held["batches"], held["micro"], strict=True):
                logits = model_forward(self.ctx.parts, inputs, None)
                micro.old_logps = token_logps(logits, labels, self.settings.temperature)[0]

    def _reuse(self, indices: list[int]) -> list[Batch]:
        """A step after the first of a generation batch: its rollouts again, against their old log-probs."""
        held = self.cache.held if self.cache is not None else None
        if held is None or held["indices"] != indices:
            raise RuntimeError(
                f"grpo: step {self.step_number} reuses the rollouts of its generation batch, but they are not "
                "held (a checkpoint from another grpo.num_iterations, or data that moved); resume with the "
                "settings the run was saved with"
            )
        self.micro, self.tokens_in_batch, self.metrics = held["micro"], held["tokens_in_batch"], {}
        return held["batches"]

    def _write_log(self, indices, prompts, completions: Completions, table: torch.Tensor) -> None:
        n = self.settings.num_generations
        weighted = (table * self.scorer.weights).nansum(dim=1)
        lines = []
        for k, ids in enumerate(completions.ids):
            values = [None if math.isnan(v) else v for v in table[k].tolist()]
            lines.append(
                {
                    "prompt_index": indices[k // n],
                    "prompt_ids": prompts[k // n],
                    "completion_ids": ids,
                    "truncated": completions.truncated[k],
                    "rewards": dict(zip(self.scorer.names, values, strict=True)),
                    "reward": None if all(v is None for v in values) else weighted[k].item(),
                    **({"logprobs": completions.logprobs[k]} if completions.logprobs is not None else {}),
                }
            )
        self.log.write(self.step_number, lines)

    def _training_batches(
        self, prompts, completions: Completions, advantages
    ) -> tuple[list[_Micro], list[Batch]]:
        """(inputs, labels, micro index) of each micro-batch: prompt then completion, padded on the right to
        the step's longest over every data-parallel rank (so a layout routes the padding as one process does:
        an MoE router counts it) and, under TP, to a multiple of its degree (sequence parallelism splits each
        sequence evenly over the tp ranks); the labels the completion's tokens; the reference's log-probs now."""
        g, device, n = self.settings, self.ctx.device, self.settings.num_generations
        size = self.plan.config.training.local_batch_size
        pad, tp = self.tokenizer.eos_id, self.plan.dims.tp
        longest = max(len(prompts[k // n]) + len(c) for k, c in enumerate(completions.ids)) - 1
        longest = torch.tensor(longest, device=device)
        if self.dp_group is not None:
            dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=self.dp_group)
        width = -(-int(longest) // tp) * tp
        micro, batches = [], []
        for m in range(0, len(completions.ids), size):
            rows = range(m, min(m + size, len(completions.ids)))
            sequences = [prompts[k // n] + completions.ids[k] for k in rows]
            inputs = torch.full((len(rows), width), pad, dtype=torch.long)
            labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
            for r, (k, seq) in enumerate(zip(rows, sequences, strict=True)):
                inputs[r, : len(seq) - 1] = torch.tensor(seq[:-1])
                start = len(prompts[k // n]) - 1
                labels[r, start : len(seq) - 1] = torch.tensor(completions.ids[k])
            inputs, labels = inputs.to(device), labels.to(device)
            mask = (labels != IGNORE_INDEX).float()
            if g.mask_truncated_completions:
                kept = torch.tensor([not completions.truncated[k] for k in rows], device=device)
                mask = mask * kept.unsqueeze(1)
            sampling = None
            if completions.logprobs is not None:
                sampling = sampling_tensor(completions.logprobs, labels, rows)
            micro.append(
                _Micro(
                    advantages[m : m + size].to(device), mask, self._reference(inputs, labels), None, sampling
                )
            )
            batches.append((inputs, labels, torch.tensor(len(batches))))
        return micro, batches

    def _reference(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        if self.source is None:
            return None
        with torch.no_grad(), whole_sequence_context(self.plan, self.ctx.forward_context):
            if self.reference_parts is not None:
                logits = self.reference_parts[0](inputs)
            else:
                with evaluating(self.ctx.parts), adapters_off(self.ctx.parts[0]):
                    logits = model_forward(self.ctx.parts, inputs, None)
        return token_logps(logits, labels, self.settings.temperature)[0]

    # -- training on them ---------------------------------------------------------------------------------

    def forward_backward(self, batch: Batch) -> torch.Tensor:
        inputs, labels, index = batch
        micro, loss_fn = self.micro[int(index)], self.loss
        if self.training_started is None:
            self.training_started = time.perf_counter()
        with whole_sequence_context(self.plan, self.ctx.forward_context):
            logits = model_forward(self.ctx.parts, inputs, None)
            logps, entropy = token_logps(logits, labels, self.settings.temperature)
        # One optimizer step per generation: the policy is its own old policy.
        old = micro.old_logps if micro.old_logps is not None else logps.detach()
        mask = micro.mask
        weights = self.correction.weights(
            old.detach(), micro.sampling_logps, mask, counted=bool(self.metrics)
        )
        per_token = loss_fn.per_token(logps, old, micro.advantages, mask, micro.ref_logps, weights)
        if loss_fn.loss_type in ("dapo", "cispo"):
            loss = loss_fn.reduce(per_token, mask, self.tokens_in_batch / self.dp_degree)
        else:
            loss = loss_fn.reduce(per_token, mask) / len(self.micro)
        loss.backward()
        self._accumulate(logps.detach(), old, micro, entropy.detach())
        return loss.detach()

    def _accumulate(self, logps, old, micro: _Micro, entropy) -> None:
        """Masked sums for TRL's global means: kl, entropy, and the low, high and region clip ratios."""
        loss_fn, mask, a = self.loss, micro.mask, micro.advantages.unsqueeze(1)
        log_ratio = loss_fn.log_ratio(logps, old, mask)
        rho = torch.exp(log_ratio)
        per_sequence = rho.shape[1] == 1
        weight, count = (torch.ones_like(rho), float(rho.shape[0])) if per_sequence else (mask, mask.sum())
        low = ((rho < 1 - loss_fn.epsilon) & (a < 0)).float()
        high = ((rho > 1 + loss_fn.high) & (a > 0)).float()
        gap = ((logps - old).abs() * mask).sum()
        kl = (
            loss_fn.kl(logps, micro.ref_logps, log_ratio)
            if micro.ref_logps is not None
            else torch.zeros_like(logps)
        )
        self.sums += torch.stack(
            [
                (kl * mask).sum(),
                mask.sum(),
                (entropy * mask).sum(),
                (low * weight).sum(),
                (high * weight).sum(),
                ((low + high).clamp(max=1) * weight).sum(),
                torch.as_tensor(count, dtype=mask.dtype, device=mask.device),
                gap,
            ]
        ).double()

    def end_step(self) -> dict[str, float]:
        trained = time.perf_counter()
        if self.requested is not None:
            self._join_request()
        sums = self.sums.clone()
        if self.dp_group is not None:
            dist.all_reduce(sums, group=self.dp_group)
        tokens, count = sums[1].clamp(min=1).item(), sums[6].clamp(min=1).item()
        metrics = dict(self.metrics)
        if self.engine is not None and self.metrics:
            metrics.update(self.correction.metrics())
        if self.loss.needs_reference:
            metrics["kl"] = sums[0].item() / tokens
        metrics["entropy"] = sums[2].item() / tokens
        if self.loss.loss_type not in ("cispo", "sapo"):
            metrics["clip_ratio/low_mean"] = sums[3].item() / count
            metrics["clip_ratio/high_mean"] = sums[4].item() / count
            metrics["clip_ratio/region_mean"] = sums[5].item() / count
        if self.pending is not None:
            metrics.update(self._off_policy_metrics(sums[7].item() / tokens, trained))
        return metrics

    def _off_policy_metrics(self, gap: float, trained: float) -> dict[str, float]:
        """The lag, the mean |current - old| log-prob over the completion tokens, and when this step trained
        and generated the next step's batch, in seconds from the step's start (overlap shows there)."""
        zero = self.step_started
        metrics = {"off_policy/lag_steps": float(self.lag), "off_policy/old_logp_gap": gap}
        metrics["off_policy/training_start_s"] = (self.training_started or trained) - zero
        metrics["off_policy/training_end_s"] = trained - zero
        if self.ahead_times is not None:
            started, ended, joined = self.ahead_times
            metrics["off_policy/generation_start_s"] = started - zero
            metrics["off_policy/generation_end_s"] = ended - zero
            if joined is not None:  # when the step waited for the request (vllm): after its training
                metrics["off_policy/joined_s"] = joined - zero
        return metrics

    def log_metrics(self) -> dict[str, float]:
        return {}

    def validator(self, batches: Callable[[], Iterable]):
        return None  # refused at start (grpo_section.check_grpo)
