"""The training loop: one readable step after another; features plug in around it."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from titan_ckpt import ModelState, OptimizerState
from titan_parallel import clip_grad_norm_, precompute_float8_scales, training_context
from titan_train.config import config_to_dict
from titan_train.config.preference_section import REFERENCE_FREE
from titan_train.distributed import DistInfo
from titan_train.faults.data_outage import StepBatches, stop_on_data_outage
from titan_train.faults.drills import FaultDrills
from titan_train.faults.step_guard import AgreedNumbers, StepGuard, StepNumbers
from titan_train.plan import RunPlan
from titan_train.reporting.device_peaks import peak_flops
from titan_train.reporting.memory_estimate import log_estimate_in_child
from titan_train.reporting.metrics import MetricsLogger, StepMetrics, device_memory, wants_colour
from titan_train.reporting.profiling import MemorySnapshots, maybe_profile
from titan_train.reporting.trainable_params import count_trainable, log_trainable
from titan_train.train_state import TrainState
from titan_train.wiring import host_memory
from titan_train.wiring.checkpointing import (
    build_checkpointer,
    find_checkpoint,
    load_found,
    write_seed_checkpoint,
)
from titan_train.wiring.data import build_loader, build_tokenizer_for, build_validation_loader, planned_steps
from titan_train.wiring.gc_schedule import GarbageCollection
from titan_train.wiring.lora import lora_enabled
from titan_train.wiring.lora_export import write_peft_adapter
from titan_train.wiring.model import build_model, check_vocabulary
from titan_train.wiring.moe import MoEBalancing, MoEStepStats, has_experts
from titan_train.wiring.mtp import MTPLoss
from titan_train.wiring.muon_after_step import MuonAfterStep
from titan_train.wiring.optimizer_in_backward import BackwardStepOptimizers, check_step_in_backward
from titan_train.wiring.optimizers import PartOptimizers, build_lr_schedule, build_optimizer
from titan_train.wiring.precision import forward_context
from titan_train.wiring.preference_pipeline import PipelinedPreference
from titan_train.wiring.preference_reference import PrecomputedReference, precompute_reference
from titan_train.wiring.preference_step import (
    PreferenceStep,
    build_reference,
    copy_starting_weights,
)
from titan_train.wiring.preference_validation import PreferenceValidator
from titan_train.wiring.qlora import DequantizedModelState, qlora_enabled, quantize_parts
from titan_train.wiring.stage_inputs import stage_inputs
from titan_train.wiring.valid_token_loss import IGNORE_INDEX
from titan_train.wiring.validation import Validator

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
    preference: dict[str, float] | None = None  # rewards and log-probs, for preference tuning


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
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.plan = plan = plan.with_steps(planned_steps(config, self.tokenizer, dp_degree))
        self.loader = build_loader(config, self.tokenizer, dp_rank, dp_degree, num_streams=plan.num_streams)
        self.closing.callback(self.loader.close)
        drills = FaultDrills(config.health, rank=info.rank, world_size=info.world_size)
        built = build_model(
            plan, self.device, eos_id=self.tokenizer.eos_id, seed=seed, drill=drills.loss_with_drill
        )
        self.model_parts, self.pipeline, self.parallel_options = built.parts, built.pipeline, plan.options
        self.preference, self.reference_parts, self.reference_logps = None, None, None
        self.preference_pipeline = None
        if config.training.dataset == "preference":
            if config.preference.reference == "precompute" and config.preference.loss not in REFERENCE_FREE:
                self.reference_logps = PrecomputedReference(len(self.loader.packed.pairs), self.device)
            references = []  # the frozen copy as built: its parts and, under a pipeline, its own schedule

            def build_copy() -> list[torch.nn.Module]:
                references.append(build_model(plan, self.device, eos_id=self.tokenizer.eos_id, seed=seed))
                return references[-1].parts

            self.reference_parts = build_reference(config, lora_enabled(config), build_copy)
            dp, pp = self.dims.submesh("dp"), self.dims.submesh("pp")
            self.preference = PreferenceStep(
                config,
                self.model_parts,
                self.reference_parts,
                self._model_forward,
                seq_len=config.training.seq_len,
                dp_degree=self.dims.dp_degree,
                group=dp.get_group() if dp is not None else None,
                precomputed=self.reference_logps,
                pp_group=pp.get_group() if pp is not None else None,
            )
            if self.pipeline is not None:
                self.preference_pipeline = PipelinedPreference(
                    self.preference, self.pipeline, references[0].pipeline if references else None
                )
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
        self.loss_fn, self.train_loss_fn = plan.loss_fn, built.train_loss_fn
        self.token_weights = built.token_weights
        self.mtp_loss = plan.loss_fn if isinstance(plan.loss_fn, MTPLoss) else None
        if self.mtp_loss is not None and self.pipeline is not None:
            pipeline = self.pipeline
            self.mtp_loss.ignore_while(lambda: pipeline.inferring_metadata)
        self.moe = MoEBalancing(self.model_parts, self.dims, has_experts(built.args))
        if config.model.print_after_conversion:
            logger.info("model:\n%s", "\n".join(map(str, self.model_parts)))
        self.forward_context = forward_context(config, self.dims, self.device)
        optimizers_class = PartOptimizers
        if config.optimizer.early_step_in_backward:
            check_step_in_backward(config, self.grad_accum_steps)
            optimizers_class = BackwardStepOptimizers
        self.optimizers = optimizers_class(
            self.model_parts,
            lambda part: build_optimizer(config, part),
            lambda optimizer: build_lr_schedule(config, optimizer, plan.steps),
        )
        self.muon = MuonAfterStep(config, self.model_parts, self.optimizers.optimizers, self.dims)
        self.state = TrainState(rank=info.rank)
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

        dump = Path(config.job.dump_folder)
        self._write_config(dump)
        self.checkpointer = build_checkpointer(
            plan,
            {
                "model": (DequantizedModelState if qlora_enabled(config) else ModelState)(self.model_parts),
                "optimizer": OptimizerState(self.model_parts, self.optimizers.optimizers),
                "lr_scheduler": self.optimizers.schedule_state(),
                "dataloader": self.loader,
                "train_state": self.state,
                **({"reference": ModelState(self.reference_parts)} if self.reference_parts else {}),
                **({"reference_logps": self.reference_logps} if self.reference_logps else {}),
            },
            model_args=built.args,
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
        if config.validation.enable and self.preference is not None:
            v = config.validation
            self.validator = PreferenceValidator(
                lambda: build_validation_loader(config, self.tokenizer, dp_rank, dp_degree),
                self.preference,
                self._preference_context,
                seq_len=v.seq_len,
                device=self.device,
                freq=v.freq,
                steps=v.steps,
            )
        elif config.validation.enable:
            v = config.validation
            self.validator = Validator(
                lambda: build_validation_loader(config, self.tokenizer, dp_rank, dp_degree),
                self._validation_loss,
                device=self.device,
                freq=v.freq,
                steps=v.steps,
            )

    def restore(self) -> bool:
        """At the start of training: resume or start from what the checkpointer finds (adopting the number
        of data streams a resumed position was saved with), or write the seed checkpoint and return True
        (the run stops there)."""
        self.state.training_steps = self.plan.steps
        if self.checkpointer is None:
            self._quantize_base()
            self._start_reference()
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
        self._start_reference()
        return False

    def _start_reference(self) -> None:
        """Preference tuning from step 0: the reference takes the starting weights, now loaded (a resumed
        run loaded the reference with the checkpoint), or gives its log-probs of every pair, computed now."""
        if self.state.step != 0:
            return
        if self.reference_parts is not None:
            copy_starting_weights(self.reference_parts, self.model_parts)
        if self.reference_logps is not None:
            dp = self.dims.submesh("dp")
            precompute_reference(
                self.reference_logps,
                self.loader.packed,
                self.model_parts,
                self._model_forward,
                self._preference_context,
                batch_size=self.config.training.local_batch_size,
                dp_rank=self.dp_rank,
                dp_degree=self.dp_degree,
                group=dp.get_group() if dp is not None else None,
                window_sums=self.preference_pipeline.reference_sums if self.preference_pipeline else None,
                pp_group=self.preference.pp_group,
            )

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

    def train_step(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> StepResult:
        """One optimizer step over `grad_accum_steps` micro-batches.

        Under FSDP, gradients of all but the last micro-batch accumulate unsharded on each rank and are
        reduce-scattered once, after the last.
        """
        if isinstance(self.optimizers, BackwardStepOptimizers):
            return self._train_step_in_backward(batches)
        self.optimizers.zero_grad()
        loss_sum = torch.zeros((), device=self.device)
        tokens, data_seconds = 0, 0.0
        trained = torch.zeros((), dtype=torch.int64, device=self.device)
        if self.preference is not None:  # the step's pairs are counted before its first forward
            start = time.perf_counter()
            step_batches = [next(batches) for _ in range(self.grad_accum_steps)]
            self.preference.begin_step(step_batches)
            batches = iter(step_batches)
            data_seconds += time.perf_counter() - start
        elif self.token_weights is not None:  # the step's trained tokens are counted before its first forward
            start = time.perf_counter()
            batches = iter(self._weigh_step([next(batches) for _ in range(self.grad_accum_steps)]))
            data_seconds += time.perf_counter() - start
        for micro in range(self.grad_accum_steps):
            for part in self.model_parts:
                if isinstance(part, FSDPModule):
                    part.set_requires_gradient_sync(micro == self.grad_accum_steps - 1)
            start = time.perf_counter()
            inputs, labels, *positions = next(batches)
            data_seconds += time.perf_counter() - start
            tokens += labels.numel()  # counted before context parallelism keeps a slice of the sequence
            trained += (labels != IGNORE_INDEX).sum()  # no host sync: read when the step is logged
            if self.preference is not None:
                pairs = self.preference_pipeline or self.preference
                loss_sum += pairs.forward_backward(
                    inputs, labels, *positions, context=self._preference_context
                )
                continue
            loss_sum += self._forward_backward(inputs, labels, *positions)
        parameters = [p for part in self.model_parts for p in part.parameters()]
        grad_norm = clip_grad_norm_(
            parameters, self.config.training.max_norm, pp_mesh=self.dims.submesh("pp")
        )
        numbers = self.guard.agree(loss_sum, grad_norm)  # the step's one collective: loss, health, signals
        preference = self.preference.end_step() if self.preference is not None else None
        if self.checkpointer is not None:
            self.checkpointer.wait_for_staging()  # a background save's copy must see the weights unchanged
        lr = self.optimizers.lr
        applied = self.optimizers.step_unless(
            numbers.skip, lambda: self.guard.decide(self.state.step + 1, numbers)
        )
        step = self.state.step + 1
        self.muon.after_step(step, applied, log=self.metrics.should_log(step))
        if applied:
            self.step_lr = lr
            if self.float8_scales_each_step:
                for part in self.model_parts:
                    precompute_float8_scales(part)
        moe = self.moe.step(applied)  # expert biases from this step's routing, summed over dp x cp ranks
        return StepResult(numbers, tokens, trained, data_seconds, moe, preference)

    def _train_step_in_backward(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> StepResult:
        """`train_step` with the optimizer stepping in backward; with clipping, a first backward measures
        the norm (see optimizer_in_backward). Context parallelism shards the batch it is given: each
        pass gets its own copy."""
        start = time.perf_counter()
        inputs, labels, *positions = next(batches)
        data_seconds = time.perf_counter() - start
        if self.token_weights is not None:
            self._weigh_step([(inputs, labels)])
        max_norm = self.config.training.max_norm
        coef = 1.0
        if max_norm > 0:
            norm = self.optimizers.measure(
                lambda: self._forward_backward(inputs.clone(), labels.clone(), *positions)
            )
            self.moe.discard_counts()  # the stepping pass routes the same tokens again
            coef = min(1.0, max_norm / (norm.item() + 1e-6))  # torch's clip_grads_with_norm_
        self.step_lr = self.optimizers.lr
        if self.checkpointer is not None:
            self.checkpointer.wait_for_staging()  # parameters move during this backward
        loss, grad_norm = self.optimizers.step(
            lambda: self._forward_backward(inputs, labels, *positions), coef
        )
        moe = self.moe.step(applied=True)  # parameters moved in backward
        numbers = self.guard.agree(loss, grad_norm)
        self.guard.decide(self.state.step + 1, numbers)
        return StepResult(numbers, labels.numel(), (labels != IGNORE_INDEX).sum(), data_seconds, moe)

    def _weigh_step(self, step_batches: list[tuple[torch.Tensor, ...]]) -> list[tuple[torch.Tensor, ...]]:
        """Count the step's trained tokens over the data-parallel ranks, so that each micro-batch's loss
        weighs its share of them (chat rows mask a different share of each row; see valid_token_loss)."""
        microbatches = self.pipeline.n_microbatches if self.pipeline is not None else 1
        dp = self.dims.submesh("dp")
        self.token_weights.begin_step(
            [batch[1] for batch in step_batches],
            self.dims.dp_degree * len(step_batches) * microbatches,
            dp.get_group() if dp is not None else None,
        )
        return step_batches

    def _layout_context(self, inputs: torch.Tensor, labels: torch.Tensor):
        """Loss and context parallelism around a forward pass, as the layout enables them: context
        parallelism shards the batch and the model's sequence buffers along the sequence."""
        positions = [buffer for part in self.model_parts for buffer in part.sequence_buffers()]
        return training_context(
            self.dims,
            self.parallel_options,
            cp_buffers=[inputs, labels, *(b for b, _ in positions)],
            cp_seq_dims=[1, 1, *(dim for _, dim in positions)],
            cp_no_restore=[inputs, labels],
            cp_models=self.model_parts,
        )

    @contextlib.contextmanager
    def _preference_context(self) -> Iterator[None]:
        """The forward context and, under TP, loss parallelism: preference log-probs are taken from the
        vocabulary-sharded logits (context parallelism is refused for preference data)."""
        with training_context(self.dims, self.parallel_options), self.forward_context():
            yield

    def _validation_loss(
        self, inputs: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Mean loss of one validation batch, forward only, through the same layout as training."""
        with self._layout_context(inputs, labels):
            if self.pipeline is not None:
                return self.pipeline.evaluate(
                    inputs, labels, **stage_inputs(self.model_parts, inputs, positions)
                )
            with self.forward_context():
                loss = self.loss_fn(self._model_forward(inputs, positions), labels)
        return loss.full_tensor() if isinstance(loss, DTensor) else loss

    def _model_forward(self, inputs: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """Logits of the one model part; chat rows pass their positions (conversations restart at 0)."""
        if positions is None:
            return self.model_parts[0](inputs)
        return self.model_parts[0](inputs, positions=positions)

    def _forward_backward(
        self, inputs: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Loss of one micro-batch, gradients accumulated. Both paths train on `train_loss_fn`, the loss
        scaled for gradient accumulation (see `micro_batch_loss`)."""
        with self._layout_context(inputs, labels):
            if self.pipeline is not None:
                return self.pipeline.step(
                    inputs, labels, **stage_inputs(self.model_parts, inputs, positions)
                ).detach()
            with self.forward_context():
                loss = self.train_loss_fn(self._model_forward(inputs, positions), labels)
            loss.backward()
        # Under loss parallelism the loss is a replicated DTensor.
        return loss.detach().full_tensor() if isinstance(loss, DTensor) else loss.detach()

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
                    fetch_seconds = batches.fetch()
                    self.state.apply_saved_rng()  # a resumed run's generators, just before its first step
                    if self.mtp_loss is not None:
                        self.mtp_loss.begin_step()
                    step = self.train_step(batches)
                self.host_memory.keep()  # from the second step on: the first allocated what the run holds
                self.state.step += 1
                self.state.tokens_seen += step.tokens * self.dims.dp_degree
                window.steps += 1
                window.tokens += step.tokens
                window.trained_tokens += step.trained_tokens
                window.data_seconds += step.data_seconds + fetch_seconds
                if self.metrics.should_log(self.state.step):
                    losses.append(self._log(step.numbers.read(), window, step.moe, step.preference))
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
        preference: dict[str, float] | None = None,
    ) -> float:
        """Log the step; return its loss. The loss is the mean over ranks, and loss_max the largest,
        as `StepGuard.agree` gathered them: the log line runs no collective of its own."""
        seconds = time.perf_counter() - window.started
        tps = window.tokens / seconds / self.devices_per_replica
        trained_tps = float(window.trained_tokens) / seconds / self.devices_per_replica
        tflops = self.flops_per_token * tps / 1e12
        memory_gib, memory_pct, memory_active_gib = device_memory(self.device)
        dp = self.dims.submesh("dp")
        mtp_loss = None
        if self.mtp_loss is not None:
            pipe = self.pipeline
            last_stage = (pipe.pp_mesh.get_group(), pipe.last_stage_rank) if pipe is not None else None
            mtp_loss = self.mtp_loss.step_mean(
                dp.get_group() if dp else None, last_stage=last_stage, device=self.device
            )
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
                mtp_loss=mtp_loss,
                preference=preference,
            )
        )
        return numbers.loss_mean
