"""The training loop: one readable step after another; features plug in around it."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.distributed.fsdp import FSDPModule

from titan_ckpt import ModelState, OptimizerState
from titan_parallel import clip_grad_norm_, precompute_float8_scales
from titan_train.config import config_to_dict
from titan_train.distributed import DistInfo
from titan_train.fault_tolerance import HealState, ReplicaGroup
from titan_train.faults.data_outage import StepBatches, stop_on_data_outage
from titan_train.faults.drills import FaultDrills
from titan_train.faults.step_guard import AgreedNumbers, StepGuard, StepNumbers
from titan_train.objectives.protocol import ObjectiveContext, TakesBatchesAhead
from titan_train.objectives.registry import build_objective
from titan_train.plan import RunPlan, one_process_plan
from titan_train.reporting.device_peaks import peak_flops
from titan_train.reporting.memory_estimate import log_estimate_in_child
from titan_train.reporting.metrics import MetricsLogger, StepMetrics, device_memory, wants_colour
from titan_train.reporting.profiling import MemorySnapshots, maybe_profile
from titan_train.reporting.trainable_params import count_trainable, log_trainable
from titan_train.step import host_memory
from titan_train.step.gc_schedule import GarbageCollection
from titan_train.step.muon_after_step import MuonAfterStep
from titan_train.step.optimizer_in_backward import BackwardStepOptimizers
from titan_train.train_state import TrainState
from titan_train.wiring.checkpointing import (
    build_checkpointer,
    find_checkpoint,
    load_found,
    write_seed_checkpoint,
)
from titan_train.wiring.data import build_loader, build_tokenizer_for, build_validation_loader, planned_steps
from titan_train.wiring.lora import lora_enabled
from titan_train.wiring.lora_export import write_peft_adapter
from titan_train.wiring.model import build_model, check_vocabulary
from titan_train.wiring.moe import MoEBalancing, MoEStepStats, has_experts
from titan_train.wiring.optimizers import PartOptimizers, build_lr_schedule, build_optimizer
from titan_train.wiring.precision import forward_context
from titan_train.wiring.qlora import DequantizedModelState, qlora_enabled, quantize_parts
from titan_train.wiring.valid_token_loss import IGNORE_INDEX

logger = logging.getLogger(__name__)


@dataclass
class _Window:
    """What happened since the last log line: the throughput numbers are averages over it. Its time is
    the wall clock since the last log line (checkpoint saves, validation and garbage collection
    included), as torchtitan counts it, so tokens/s compare like for like."""

    steps: int = 0
    tokens: int = 0
    trained_tokens: torch.Tensor | int = 0  # labels that count in the loss, summed on the device
    data_seconds: float = 0.0
    started: float = field(default_factory=time.perf_counter)


@dataclass
class StepResult:
    """One step as its log line reports it: the numbers every rank agreed on (loss, grad norm), the
    tokens this rank read and those it trained on, and the seconds it waited for them."""

    numbers: StepNumbers
    tokens: int
    trained_tokens: torch.Tensor  # this rank's labels that count in the loss (not -100), on the device
    data_seconds: float
    moe: MoEStepStats | None = None  # expert load and aux loss, for a model with experts
    # The objective's own metrics: TRL's rewards and log-probs for preference tuning.
    objective: dict[str, float] | None = None
    committed: bool = True  # False: a replica group failed during the step, which is trained again


class Trainer:
    """Builds every part of a job from its plan, then trains: `Trainer(resolve(config, ...), dist_info).train()`.

    The config is one `load_job_config` read and `check_run` passed for this world size and device,
    resolved into a plan (`titan_train.plan.resolve`); titan-train does all three before it joins the
    process group.
    """

    def __init__(self, plan: RunPlan, info: DistInfo, closing: contextlib.ExitStack | None = None):
        """`closing` is the stack the run's resources are closed by (see `train`); the command line
        passes its own, which already holds the peer watch."""
        config = plan.config
        self.plan, self.config, self.info = plan, config, info
        self.closing = contextlib.ExitStack() if closing is None else closing
        self.device = info.device
        # Activations live in host memory on CPU: the steps may keep freed blocks (the loads and exports do not).
        self.host_memory = host_memory.KeptHostMemory(self.device.type == "cpu" and host_memory.wanted())
        seed = plan.seed
        torch.manual_seed(seed)
        if config.debug.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=config.debug.deterministic_warn_only)

        self.dims = plan.dims
        self.mesh = self.dims.build_mesh(self.device.type)
        dp_mesh = self.dims.submesh("dp")
        dp_rank, dp_degree = (dp_mesh.get_local_rank(), dp_mesh.size()) if dp_mesh else (0, 1)
        self.grad_accum_steps = plan.grad_accum_steps

        self.tokenizer = build_tokenizer_for(config)
        check_vocabulary(plan, self.tokenizer)
        dump = Path(config.job.dump_folder)
        self.replicas = None
        if (
            config.fault_tolerance.enable
        ):  # torchft replica groups: the data is split over every group's ranks
            ft = config.fault_tolerance
            self.replicas = ReplicaGroup(
                ft,
                rank=info.rank,
                world_size=info.world_size,
                dump=dump,
                semi_sync=ft.semi_sync_method is not None,
            )
            self.closing.callback(self.replicas.close)
            dp_rank, dp_degree = self.replicas.data_rank(dp_rank, dp_degree)
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.plan = plan = plan.with_steps(planned_steps(config, self.tokenizer, dp_degree))
        self.loader = build_loader(config, self.tokenizer, dp_rank, dp_degree, num_streams=plan.num_streams)
        self.closing.callback(self.loader.close)
        drills = FaultDrills(config.health, rank=info.rank, world_size=info.world_size)
        built = build_model(
            plan, self.device, eos_id=self.tokenizer.eos_id, seed=seed, drill=drills.loss_with_drill
        )
        self.model_parts, self.pipeline, self.parallel_options = built.parts, built.pipeline, plan.options
        # Graphs compile at their first forward: a memory budget must hold until the run ends.
        self.closing.enter_context(plan.options.activation_checkpoint.compiler_settings())
        self.guard = StepGuard(
            config.health,
            rank=info.rank,
            world_size=info.world_size,
            device=self.device,
            drills=drills,
            watched_parts=self.model_parts,
        )
        float8 = plan.options.float8
        self.float8_scales_each_step = (
            float8 is not None
            and float8.fsdp_all_gather
            and config.quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp
        )
        self.loss_fn = plan.loss_fn
        self.moe = MoEBalancing(self.model_parts, self.dims, has_experts(built.args))
        if config.model.print_after_conversion:
            logger.info("model:\n%s", "\n".join(map(str, self.model_parts)))
        self.forward_context = forward_context(config, self.dims, self.device)
        whole_plan = functools.cache(lambda: one_process_plan(config, self.device.type))
        self.objective = build_objective(
            plan.objective,
            ObjectiveContext(
                plan=plan,
                device=self.device,
                parts=self.model_parts,
                pipeline=self.pipeline,
                train_loss_fn=built.train_loss_fn,
                loss_fn=plan.loss_fn,
                token_weights=built.token_weights,
                tokenizer=self.tokenizer,
                loader=self.loader,
                forward_context=self.forward_context,
                build_copy=lambda: build_model(plan, self.device, eos_id=self.tokenizer.eos_id, seed=seed),
                build_whole=lambda: build_model(
                    whole_plan(), self.device, eos_id=self.tokenizer.eos_id, seed=seed, materialize=False
                ).parts[0],
            ),
        )
        optimizers_class = PartOptimizers
        if config.optimizer.early_step_in_backward:  # its rules: the plan's (step_in_backward_problems)
            optimizers_class = BackwardStepOptimizers
        self.optimizers = optimizers_class(
            self.model_parts,
            lambda part: build_optimizer(config, part),
            lambda optimizer: build_lr_schedule(config, optimizer, plan.steps),
        )
        self.muon = MuonAfterStep(config, self.model_parts, self.optimizers.optimizers, self.dims)
        self.state = TrainState(rank=info.rank)
        if self.replicas is not None:
            others = {"lr_scheduler": self.optimizers.schedule_state(), "train_state": self.state}
            self.replicas.register(HealState(self.model_parts, self.optimizers.optimizers, others))
        self.step_lr = config.optimizer.lr  # the lr of the last step taken, for its log line
        # A replica (one data-parallel rank's batch) spans tp * cp * pp devices.
        self.devices_per_replica = self.dims.tp * self.dims.cp * self.dims.pp

        self.flops_per_token = plan.flops_per_token
        self.peak_flops = peak_flops(self.device)
        logger.info(
            "model %s %s: %s parameters; %s on %s, world size %d, gradient accumulation %d",
            config.model.name,
            config.model.flavor,
            f"{plan.params.total:,}",
            self.dims.degrees,
            self.device.type,
            info.world_size,
            self.grad_accum_steps,
        )
        pp = self.dims.submesh("pp")
        total, trainable = count_trainable(self.model_parts, pp.get_group() if pp else None, self.device)
        log_trainable(total, trainable)
        if config.memory_estimation.enable and info.rank == 0:
            how = "real" if config.memory_estimation.disable_fake_mode else "fake"
            logger.info("memory estimate: tracing one step on %s tensors in a child process", how)
            log_estimate_in_child(plan)

        self._write_config(dump)
        self.checkpointer = build_checkpointer(
            plan,
            {
                "model": (DequantizedModelState if qlora_enabled(config) else ModelState)(self.model_parts),
                "optimizer": OptimizerState(self.model_parts, self.optimizers.optimizers),
                "lr_scheduler": self.optimizers.schedule_state(),
                "dataloader": self.loader,
                "train_state": self.state,
                **self.objective.states(),
            },
            model_args=built.args,
            replicas=self.replicas,
        )
        if self.checkpointer is not None:
            self.closing.enter_context(self.checkpointer)
        m = config.metrics
        self.metrics = MetricsLogger(
            log_freq=m.log_freq,
            dump=dump,
            rank=info.rank,
            color=wants_colour(m.disable_color_printing),
            tb_folder=dump / m.save_tb_folder if m.enable_tensorboard else None,
            all_ranks=m.save_for_all_ranks,
            wandb_config=config_to_dict(config) if m.enable_wandb else None,
        )
        self.closing.callback(self.metrics.close)
        self.validator = None
        if config.validation.enable:
            self.validator = self.objective.validator(
                lambda: build_validation_loader(config, self.tokenizer, dp_rank, dp_degree)
            )

    def restore(self) -> bool:
        """At the start of training: resume or start from what the checkpointer finds (adopting the number
        of data streams a resumed position was saved with), or write the seed checkpoint and return True
        (the run stops there)."""
        self.state.training_steps = self.plan.steps
        if self.checkpointer is None:
            self._quantize_base()
            self.objective.start(self.state.step, self.loader)
            return False
        if self.config.checkpoint.create_seed_checkpoint:
            write_seed_checkpoint(self.checkpointer)
            return True
        found = find_checkpoint(self.checkpointer, self.config)
        if found.saved_streams is not None:
            self.plan = self.plan.with_streams(found.saved_streams)
            self.loader = build_loader(
                self.config, self.tokenizer, self.dp_rank, self.dp_degree, num_streams=self.plan.num_streams
            )
            self.closing.callback(self.loader.close)
            self.checkpointer.states["dataloader"] = self.loader
        load_found(self.checkpointer, found, self.state, self.plan.steps)
        self._quantize_base()
        self.objective.start(self.state.step, self.loader)
        return False

    def _quantize_base(self) -> None:
        """QLoRA: the base, now loaded, into NF4 (see `titan_train.wiring.qlora`)."""
        if qlora_enabled(self.config):
            quantize_parts(self.model_parts, self.config)

    def _write_config(self, dump: Path) -> None:
        resolved = json.dumps(config_to_dict(self.config), indent=2)
        if self.config.job.print_config:
            logger.info("configuration:\n%s", resolved)
        if self.info.rank == 0:
            dump.mkdir(parents=True, exist_ok=True)
            (dump / "config.json").write_text(resolved)
            if self.config.job.save_config_file:
                (dump / self.config.job.save_config_file).write_text(resolved)

    def _batches(self) -> Iterator[tuple[torch.Tensor, ...]]:
        """(inputs, labels) batches on the device; chat rows add their per-token positions."""
        # On CUDA, copied from pinned memory without waiting: a copy from pageable memory makes the
        # host wait for the previous step's optimizer before it can queue this step's forward pass.
        pinned = self.device.type == "cuda"
        for batch in self.loader:
            if pinned:
                batch = tuple(t.pin_memory() for t in batch)
            yield tuple(t.to(self.device, non_blocking=pinned) for t in batch)

    def _steps_of_batches(self) -> int:
        """How many steps' micro-batches the next step takes: its own, or what an objective that trains on
        what it made from earlier batches asks for (`TakesBatchesAhead`)."""
        ahead = self.objective
        return ahead.steps_of_batches(self.state.step + 1) if isinstance(ahead, TakesBatchesAhead) else 1

    def train_step(self, batches: Iterator[tuple[torch.Tensor, ...]]) -> StepResult:
        """One optimizer step over `grad_accum_steps` micro-batches, each handed to the objective.

        The step's micro-batches are taken first, so that the objective can count them (tokens, pairs)
        before the first forward. Under FSDP, gradients of all but the last micro-batch accumulate
        unsharded on each rank and are reduce-scattered once, after the last.
        """
        if isinstance(self.optimizers, BackwardStepOptimizers):
            return self._train_step_in_backward(batches)
        self.optimizers.zero_grad()
        if self.replicas is not None:
            self.replicas.begin_step()
        loss_sum = torch.zeros((), device=self.device)
        start = time.perf_counter()
        step_batches = [next(batches) for _ in range(self.grad_accum_steps * self._steps_of_batches())]
        step_batches = self.objective.begin_step(step_batches) or step_batches
        data_seconds = time.perf_counter() - start
        tokens = 0
        trained = torch.zeros((), dtype=torch.int64, device=self.device)
        for micro, batch in enumerate(step_batches):
            for part in self.model_parts:
                if isinstance(part, FSDPModule):
                    part.set_requires_gradient_sync(micro == self.grad_accum_steps - 1)
            labels = batch[1]
            tokens += labels.numel()  # counted before context parallelism keeps a slice of the sequence
            trained += (labels != IGNORE_INDEX).sum()  # no host sync: read when the step is logged
            loss_sum += self.objective.forward_backward(batch)
        parameters = [p for part in self.model_parts for p in part.parameters()]
        if self.replicas is not None:
            self.replicas.average_gradients(parameters)
        grad_norm = clip_grad_norm_(
            parameters, self.config.training.max_norm, pp_mesh=self.dims.submesh("pp")
        )
        numbers = self.guard.agree(loss_sum, grad_norm)  # the step's one collective: loss, health, signals
        objective_metrics = self.objective.end_step()
        if self.checkpointer is not None:
            self.checkpointer.wait_for_staging()  # a background save's copy must see the weights unchanged
        # The replica groups agree to commit (a healing group receives the live state here); if not, no update.
        committed = self.replicas is None or self.replicas.commit(self.state.step + 1)
        skip = numbers.skip if committed else torch.ones_like(numbers.skip)
        lr = self.optimizers.lr
        applied = self.optimizers.step_unless(
            skip, lambda: self.guard.decide(self.state.step + 1, numbers) and committed
        )
        step = self.state.step + 1
        self.muon.after_step(step, applied, log=self.metrics.should_log(step))
        if applied:
            self.step_lr = lr
            if self.float8_scales_each_step:
                for part in self.model_parts:
                    precompute_float8_scales(part)
        moe = self.moe.step(applied)  # expert biases from this step's routing, summed over dp x cp ranks
        return StepResult(numbers, tokens, trained, data_seconds, moe, objective_metrics, committed)

    def _train_step_in_backward(self, batches: Iterator[tuple[torch.Tensor, ...]]) -> StepResult:
        """`train_step` with the optimizer stepping in backward; with clipping, a first backward measures
        the norm (see optimizer_in_backward). Context parallelism shards the batch it is given: each
        pass gets its own copy."""
        start = time.perf_counter()
        inputs, labels, *rest = next(batches)
        data_seconds = time.perf_counter() - start
        self.objective.begin_step([(inputs, labels, *rest)])
        max_norm = self.config.training.max_norm
        coef = 1.0
        if max_norm > 0:
            norm = self.optimizers.measure(
                lambda: self.objective.forward_backward((inputs.clone(), labels.clone(), *rest))
            )
            self.moe.discard_counts()  # the stepping pass routes the same tokens again
            coef = min(1.0, max_norm / (norm.item() + 1e-6))  # torch's clip_grads_with_norm_
        self.step_lr = self.optimizers.lr
        if self.checkpointer is not None:
            self.checkpointer.wait_for_staging()  # parameters move during this backward
        loss, grad_norm = self.optimizers.step(
            lambda: self.objective.forward_backward((inputs, labels, *rest)), coef
        )
        moe = self.moe.step(applied=True)  # parameters moved in backward
        numbers = self.guard.agree(loss, grad_norm)
        self.guard.decide(self.state.step + 1, numbers)
        objective_metrics = self.objective.end_step()
        return StepResult(
            numbers, labels.numel(), (labels != IGNORE_INDEX).sum(), data_seconds, moe, objective_metrics
        )

    def train(self) -> list[float]:
        """Train to the plan's steps (`training.steps`, or `training.epochs` counted), resuming from a
        checkpoint if there is one; return the logged losses.

        When it ends, however it ends, everything the run opened is closed by `self.closing`, in the
        reverse order of opening: preemption signals, profiler, snapshots, garbage collection, metrics,
        checkpointer (a save still in flight is published after a clean run), loader workers, and
        the peer watch of a run started from the command line.
        """
        with self.closing as closing:
            if self.restore():
                return []
            if self.replicas is not None:  # LocalSGD's or DiLoCo's hooks on the restored weights
                closing.enter_context(self.replicas.training(self.model_parts, self.optimizers.optimizers))
            closing.callback(self.host_memory.close)
            self.metrics.resume_from(self.state.step)
            c, rank, dump = self.config, self.info.rank, Path(self.config.job.dump_folder)
            # Remote data on several ranks: a step's batches are taken before its collectives, and the
            # ranks agree that all have them, so an outage on one rank stops all at a clean step.
            per_step = 1 if isinstance(self.optimizers, BackwardStepOptimizers) else self.grad_accum_steps
            remote = self.loader.remote and self.info.world_size > 1
            batches = StepBatches(self._batches(), per_step, agree=remote)
            losses: list[float] = []
            window = _Window()
            gc_schedule = GarbageCollection(c.training.gc_freq, c.training.gc_debug)
            closing.callback(gc_schedule.close)
            snapshots = MemorySnapshots(
                enabled=c.profiling.enable_memory_snapshot,
                folder=dump / c.profiling.save_memory_snapshot_folder,
                freq=c.profiling.profile_freq,
                rank=rank,
            )
            closing.callback(snapshots.close)
            profiler = closing.enter_context(
                maybe_profile(
                    enabled=c.profiling.enable_profiling,
                    folder=dump / c.profiling.save_traces_folder,
                    freq=c.profiling.profile_freq,
                    warmup=c.profiling.profiler_warmup,
                    active=c.profiling.profiler_active,
                    rank=rank,
                    first_step=self.state.step,
                )
            )
            closing.enter_context(
                self.guard
            )  # preemption signals: stop after the current step, with a checkpoint
            while self.state.step < self.plan.steps:
                self.guard.begin_step(self.state.step + 1)
                with stop_on_data_outage(self.state.step, self.checkpointer, self.loader):
                    fetch_seconds = batches.fetch(self._steps_of_batches())
                    self.state.apply_saved_rng()  # a resumed run's generators, just before its first step
                    step = self.train_step(batches)
                if not step.committed:
                    continue  # a replica group failed during it: the step is trained again
                self.host_memory.keep()  # from the second step on: the first allocated what the run holds
                self.state.step += 1
                self.state.tokens_seen += step.tokens * self.dims.dp_degree
                window.steps += 1
                window.tokens += step.tokens
                window.trained_tokens += step.trained_tokens
                window.data_seconds += step.data_seconds + fetch_seconds
                if self.metrics.should_log(self.state.step):
                    losses.append(self._log(step.numbers.read(), window, step.moe, step.objective))
                    window = _Window()
                if self.validator is not None and self.validator.should_validate(self.state.step):
                    with stop_on_data_outage(self.state.step, self.checkpointer):
                        result = self.validator.validate(self.model_parts)
                        if isinstance(result, dict):  # preference pairs: loss and TRL's metrics
                            self.metrics.log_preference_validation(self.state.step, result)
                        else:
                            self.metrics.log_validation(self.state.step, *result)
                last_step = self.state.step == self.plan.steps
                if self.checkpointer is not None and last_step:
                    with self.host_memory.released():  # the whole state saved and exported once
                        self.checkpointer.maybe_save(self.state.step, last_step=True)
                        self._export_peft_adapter()
                elif self.checkpointer is not None:
                    self.checkpointer.maybe_save(self.state.step)
                self.guard.end_step(self.state.step, last_step=last_step, checkpointer=self.checkpointer)
                gc_schedule.step(self.state.step)
                snapshots.step(self.state.step)
                profiler.step()
            if self.replicas is not None:
                self.replicas.record_digest(self.state.step)
        logger.info("training done at step %d", self.state.step)
        return losses

    def _export_peft_adapter(self) -> None:
        """A LoRA run's adapters as a PEFT folder beside the last step's Hugging Face export."""
        c = self.config.checkpoint
        if not (lora_enabled(self.config) and c.last_save_in_hf and not c.load_only):
            return
        ckpt = self.checkpointer
        write_peft_adapter(
            self.config,
            ckpt.states["model"].state_dict(),
            ckpt.hf_adapter.base,
            ckpt.step_folder(self.state.step),
            lora=self.plan.options.lora,
        )

    def _log(
        self,
        numbers: AgreedNumbers,
        window: _Window,
        moe: MoEStepStats | None,
        objective: dict[str, float] | None = None,
    ) -> float:
        """Log the step; return its loss. The loss is the mean over ranks, and loss_max the largest,
        as `StepGuard.agree` gathered them; the objective's own metrics beside them (MTP's loss is
        gathered here, on logged steps only)."""
        seconds = time.perf_counter() - window.started
        tps = window.tokens / seconds / self.devices_per_replica
        trained_tps = float(window.trained_tokens) / seconds / self.devices_per_replica
        tflops = self.flops_per_token * tps / 1e12
        memory_gib, memory_pct, memory_active_gib = device_memory(self.device)
        objective = {**(objective or {}), **self.objective.log_metrics()}
        self.metrics.log(
            StepMetrics(
                step=self.state.step,
                loss=numbers.loss_mean,
                loss_max=numbers.loss_max,
                grad_norm=numbers.grad_norm,
                lr=self.step_lr,
                tokens_seen=self.state.tokens_seen,
                tps=tps,
                trained_tps=trained_tps,
                tflops=tflops,
                mfu=100 * tflops * 1e12 / self.peak_flops if self.peak_flops else None,
                memory_gib=memory_gib,
                memory_pct=memory_pct,
                memory_active_gib=memory_active_gib,
                data_time_s=window.data_seconds / window.steps,
                data_time_pct=100 * window.data_seconds / seconds,
                step_time_s=seconds / window.steps,
                expert_load=moe.load() if moe is not None else None,
                expert_counts=moe.counts if moe is not None else None,
                aux_loss=moe.aux_loss if moe is not None else None,
                objective=objective or None,
                fault_tolerance=self.replicas.counts.metrics() if self.replicas is not None else None,
            )
        )
        return numbers.loss_mean
