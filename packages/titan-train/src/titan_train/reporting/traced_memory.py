"""One training step of a config traced for one rank: the model and layout it configures, on fake tensors.

The step is the trainer's: zero the gradients, forward and backward over every micro-batch (or the
pipeline schedule), clip the gradient norm, step the optimizer. The optimizer state is created
first (one optimizer step on zero gradients), as it exists in every step but the first. On fake tensors
(torch's `FakeTensorMode`) nothing is allocated or computed; with `fake=False` the same code runs on
real tensors, which is how the tests check the trace against what a real step holds.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from dataclasses import replace

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from titan_parallel import blocks_of, clip_grad_norm_, precompute_float8_scales, training_context
from titan_parallel.cuda_kernel_memory import cuda_attention_memory, use_cuda_kernel_memory
from titan_parallel.memory_trace import MemoryTrace, TraceResult
from titan_parallel.pipeline_replay import ReplayError, can_replay, replaying_microbatches
from titan_train.plan import RunPlan, counting_args
from titan_train.step.stage_inputs import stage_inputs
from titan_train.wiring.model import build_model
from titan_train.wiring.optimizers import build_optimizer
from titan_train.wiring.precision import autocast_dtype
from titan_train.wiring.qlora import qlora_enabled, quantize_parts

logger = logging.getLogger(__name__)


def fake_world(world_size: int, rank: int) -> None:
    """A fake process group of `world_size` in which this process is `rank`: collectives answer at once."""
    if dist.is_initialized():
        raise RuntimeError("a memory trace builds its own (fake) process group: run it in a fresh process")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def trace_rank(plan: RunPlan, rank: int, **kwargs) -> TraceResult:
    """Trace one step as rank `rank` of the plan's world sees it, on a fake process group of its own."""
    fake_world(plan.world_size, rank)
    try:
        return trace_step(plan, **kwargs)
    except ReplayError as err:  # micro-batches that do not repeat after all: run them all
        logger.warning("memory trace: %s does not repeat the one captured; tracing every micro-batch", err)
        return trace_step(plan, **{**kwargs, "replay_microbatches": False})
    finally:
        dist.destroy_process_group()


def trace_step(
    plan: RunPlan,
    *,
    fake: bool = True,
    n_layers: int | None = None,
    replay_microbatches: bool = True,
) -> TraceResult:
    """Trace one step of `plan` on this rank of the process group that is already initialised.

    `n_layers` builds the model with that many blocks (the estimate traces a few and scales). The
    plan's device picks the dtypes (resolve for "cuda" to plan for GPUs: CPU keeps float32 where GPUs
    use bf16). Fake tensors live on the CPU; real ones (`fake=False`) on the plan's device, so that on
    a GPU the same tracker follows what the real step holds there. A fake pipeline step runs three
    micro-batches of each stage and replays the others (`titan_parallel.pipeline_replay`) unless
    `replay_microbatches` is False. The model is built by training's own builder (`build_model`), and
    trained on its loss, scaled once for gradient accumulation there.
    """
    config, target_device = plan.config, plan.device_type
    device = torch.device("cpu" if fake else target_device)
    trace = MemoryTrace()

    def labelled_loss(logits, labels, loss_fn=plan.loss_fn):
        trace.label(("loss",))
        return loss_fn(logits, labels)

    # A mesh of this trace's own (the plan's degrees), and the plan's loss labelled for the trace.
    dims = replace(plan.dims)
    dims.build_mesh(device.type)
    plan = replace(plan, dims=dims, loss_fn=labelled_loss)
    built = build_model(
        plan,
        device,
        eos_id=counting_args(plan.model_args).eos_id,
        seed=0,
        n_layers=n_layers,
        materialize=not fake,
    )
    parts, pipeline, args = built.parts, built.pipeline, built.args
    mode = torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    # Fake tensors live on the CPU: ops keep what CUDA kernels keep (use_cuda_kernel_memory below too).
    kernels = cuda_attention_memory() if fake and target_device == "cuda" else contextlib.nullcontext()
    with mode, kernels:
        if fake:  # meta -> fake; a fake model is built on meta first: deep copies of fake tensors lose their views' storage
            for part in parts:
                part.to_empty(device=device)
                if target_device == "cuda":
                    use_cuda_kernel_memory(part)
        if qlora_enabled(config):  # the base as training holds it once loaded: NF4 codes and scales
            quantize_parts(parts, config)
        if pipeline is not None and dist.get_backend() == "fake":
            _declare_stage_shapes(pipeline, plan, args)
        optimizers = [build_optimizer(config, part) for part in parts]
        t = config.training
        inputs = torch.randint(0, args.vocab_size, (t.local_batch_size, t.seq_len), device=device)
        labels = torch.randint(0, args.vocab_size, (t.local_batch_size, t.seq_len), device=device)
        params = [p for part in parts for p in part.parameters()]
        _create_optimizer_state(params, optimizers)
        with trace, _no_automatic_gc():
            trace.track(params, "parameters")
            trace.track([s for o in optimizers for s in _state_tensors(o)], "optimizer state")
            trace.track([b for part in parts for b in part.buffers()] + [inputs, labels])
            for i, part in enumerate(parts):
                trace.watch_blocks(i, blocks_of(part).values())
            replay = (
                fake and replay_microbatches and pipeline and can_replay(pipeline.schedule, pipeline.stages)
            )
            replaying = replaying_microbatches(trace, pipeline.schedule, pipeline.stages) if replay else None
            with replaying or contextlib.nullcontext():
                _one_step(plan, built, optimizers, trace, inputs, labels)
            trace.remove_hooks()
            trace.assign("parameters", params)
        return trace.result()


def _one_step(plan, built, optimizers, trace, inputs, labels) -> None:
    config, dims, accum = plan.config, plan.dims, plan.grad_accum_steps
    parts, pipeline, loss_fn = built.parts, built.pipeline, built.train_loss_fn
    if (
        built.token_weights is not None
    ):  # chat data: the trace's labels are all trained, each micro-batch weighs 1
        built.token_weights.begin_step([labels] * accum, accum * (pipeline.n_microbatches if pipeline else 1))
    # The trainer's autocast on the target device (one GPU without FSDP); on fake tensors, which live on
    # the CPU, emulated by CPU autocast: both run matmuls and attention in the lower precision.
    dtype = autocast_dtype(config, dims, torch.device(plan.device_type))

    def autocast():
        return (
            torch.autocast(inputs.device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
        )

    trace.label(("zero_grad",))
    for optimizer in optimizers:
        optimizer.zero_grad()
    for micro in range(accum):
        for part in parts:
            if isinstance(part, FSDPModule):
                part.set_requires_gradient_sync(micro == accum - 1)
        trace.label(("forward start",))
        buffers = [inputs, labels, *(buffer for part in parts for buffer, _ in part.sequence_buffers())]
        with training_context(
            dims, plan.options, cp_buffers=buffers, cp_seq_dims=[1, 1, *[0] * len(parts)], cp_models=parts
        ):
            if pipeline is not None:
                pipeline.step(inputs, labels, **stage_inputs(parts, inputs))
            else:
                with autocast():
                    loss = loss_fn(parts[0](inputs), labels)
                # Its own label: until the last block's backward starts, the loss's backward (the
                # logits' gradient) runs beside what forward left, and its peak grows per block at
                # another rate than the forward's, so the two must scale separately.
                trace.label(("loss backward",))
                loss.backward()
    params = [p for part in parts for p in part.parameters()]
    trace.assign("gradients", [p.grad for p in params if p.grad is not None])
    trace.label(("clip",))
    clip_grad_norm_(params, config.training.max_norm, pp_mesh=dims.submesh("pp"))
    trace.label(("optimizer",))
    for optimizer in optimizers:
        optimizer.step()
        trace.assign("optimizer state", _state_tensors(optimizer))
    float8 = plan.options.float8
    if (
        float8 is not None
        and float8.fsdp_all_gather
        and (config.quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp)
    ):
        for part in parts:
            precompute_float8_scales(part)


@contextlib.contextmanager
def _no_automatic_gc():
    """The trainer collects garbage between steps, never during one (`titan_train.step.gc_schedule`): what a step
    leaves in reference cycles stays until the step ends, in the trace as in training."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _create_optimizer_state(params: list, optimizers: list) -> None:
    """Step the optimizers once on zero gradients: the traced step then holds optimizer state, as every
    step but the first does."""
    for p in params:
        if p.requires_grad:  # a frozen base (LoRA's, QLoRA's NF4 one) has no gradient
            p.grad = torch.zeros_like(p)
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def _declare_stage_shapes(pipeline, plan: RunPlan, args) -> None:
    """Tell each pipeline stage the shapes it sends and receives: on a fake process group torch cannot
    infer them by asking the neighbouring stages, as it does in a real run."""
    from torch.distributed.pipelining._utils import _StageMeta, extract_tensor_metas

    t, p, dims, options = plan.config.training, plan.config.parallelism, plan.dims, plan.options
    mb = p.pipeline_parallel_microbatch_size
    seq = t.seq_len // dims.cp
    dtype = (
        options.data_parallel.param_dtype
        if dims.fsdp_enabled
        else next(pipeline.model_parts[0].parameters()).dtype
    )
    split = dims.tp if dims.tp > 1 and options.tensor_parallel.sequence_parallel else 1
    device = torch.device("cpu")
    hidden = torch.empty(mb, seq // split, args.dim, dtype=dtype, device=device)
    tokens = torch.empty(mb, seq, dtype=torch.long, device=device)
    if dims.tp > 1 and options.tensor_parallel.loss_parallel:
        local = torch.empty(mb, seq, args.vocab_size // dims.tp, dtype=dtype, device=device)
        logits = DTensor.from_local(local, dims.submesh("tp"), [Shard(2)], run_check=False)
    else:
        logits = torch.empty(mb, seq, args.vocab_size, dtype=dtype, device=device)
    for stage in pipeline.stages:
        inputs = (tokens,) if stage.is_first else (_requiring_grad(hidden),)
        outputs = (logits,) if stage.is_last else (hidden,)
        in_grads = (None,) if stage.is_first else (hidden,)
        stage._user_meta = _StageMeta(
            inputs=extract_tensor_metas(inputs),
            outputs=extract_tensor_metas(tuple(map(_requiring_grad, outputs))),
            input_grads=extract_tensor_metas(in_grads, allow_none=True),
            output_grads=extract_tensor_metas(outputs, allow_none=True),
        )
        stage._mesh_cache.update_from_tensors(outputs)
        _release_sent_outputs(stage)


def _requiring_grad(t: torch.Tensor) -> torch.Tensor:
    """Activations between stages require grad, as a real run's shape inference finds: else a stage
    computes no gradient for its input, sends zeros back, and holds other buffers than a real one."""
    return t.detach().requires_grad_()


def _release_sent_outputs(stage) -> None:
    """A stage frees its output once sent only if its type is exactly `torch.Tensor`: a fake tensor's is
    not, so a fake stage would keep every output it sent until its backward, which a real stage does not."""
    with unset_fake_temporarily():
        plain = torch.empty(0, device="meta")
    releasable = stage._output_slot_is_releasable
    stage._output_slot_is_releasable = lambda out: releasable(plain if type(out) is FakeTensor else out)
