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
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from titan_parallel import blocks_of, clip_grad_norm_, precompute_float8_scales, training_context
from titan_parallel.cuda_kernel_memory import use_cuda_kernel_memory
from titan_parallel.memory_trace import MemoryTrace, TraceResult
from titan_parallel.pipeline_replay import ReplayError, can_replay, replaying_microbatches
from titan_train.registry import get_model_spec
from titan_train.wiring.hf_interop import model_args
from titan_train.wiring.model import autocast_dtype, build_loss_fn, build_model
from titan_train.wiring.optimizers import build_optimizer
from titan_train.wiring.parallelism import build_parallel_dims, gradient_accumulation_steps

logger = logging.getLogger(__name__)


def fake_world(world_size: int, rank: int) -> None:
    """A fake process group of `world_size` in which this process is `rank`: collectives answer at once."""
    if dist.is_initialized():
        raise RuntimeError("a memory trace builds its own (fake) process group: run it in a fresh process")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def trace_rank(config: Any, world_size: int, rank: int, **kwargs) -> TraceResult:
    """Trace one step as rank `rank` of `world_size` sees it, on a fake process group of its own."""
    fake_world(world_size, rank)
    try:
        return trace_step(config, world_size, **kwargs)
    except ReplayError as err:  # micro-batches that do not repeat after all: run them all
        logger.warning("memory trace: %s does not repeat the one captured; tracing every micro-batch", err)
        return trace_step(config, world_size, **{**kwargs, "replay_microbatches": False})
    finally:
        dist.destroy_process_group()


def trace_step(
    config: Any,
    world_size: int,
    *,
    fake: bool = True,
    n_layers: int | None = None,
    target_device: str = "cuda",
    replay_microbatches: bool = True,
) -> TraceResult:
    """Trace one step of `config` on this rank of the process group that is already initialised.

    `n_layers` builds the model with that many blocks (the estimate traces a few and scales);
    `target_device` picks the dtypes the real run would use (CPU keeps float32 where GPUs use bf16).
    Fake tensors live on the CPU; real ones (`fake=False`) on `target_device`, so that on a GPU the
    same tracker follows what the real step holds there. A fake pipeline step runs three micro-batches
    of each stage and replays the others (`titan_parallel.pipeline_replay`) unless `replay_microbatches`
    is False.
    """
    device = torch.device("cpu" if fake else target_device)
    spec = get_model_spec(config.model.name)
    dims = build_parallel_dims(config, world_size)
    dims.build_mesh(device.type)
    dp_mesh = dims.submesh("dp")
    accum = gradient_accumulation_steps(config, dp_mesh.size() if dp_mesh else 1)
    trace = MemoryTrace()

    configured_loss = build_loss_fn(config, spec)

    def labelled_loss(logits, labels):
        trace.label(("loss",))
        return configured_loss(logits, labels)

    spec = replace(spec, loss_fn=labelled_loss)
    args = model_args(config)  # the flavor, or the checkpoint's config.json for `from_hf`
    tokenizer = SimpleNamespace(eos_id=args.eos_id, vocab_size=0)
    built = build_model(
        config, spec, tokenizer, dims, device, seed=0, grad_accum_steps=accum,
        n_layers=n_layers, dtype_device=torch.device(target_device), materialize=not fake,
    )  # fmt: skip
    parts, pipeline = built.parts, built.pipeline
    mode = torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    with mode:
        if fake:  # meta -> fake; a fake model is built on meta first: deep copies of fake tensors lose their views' storage
            for part in parts:
                part.to_empty(device=device)
                if target_device == "cuda":  # fake tensors live on the CPU: ops keep what CUDA kernels keep
                    use_cuda_kernel_memory(part)
        if pipeline is not None and dist.get_backend() == "fake":
            _declare_stage_shapes(pipeline, built, dims, config)
        optimizers = [build_optimizer(config, part) for part in parts]
        t = config.training
        inputs = torch.randint(0, args.vocab_size, (t.local_batch_size, t.seq_len), device=device)
        labels = torch.randint(0, args.vocab_size, (t.local_batch_size, t.seq_len), device=device)
        params = [p for part in parts for p in part.parameters()]
        loss_fn = spec.loss_fn if accum == 1 else (lambda x, y: spec.loss_fn(x, y) / accum)
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
                _one_step(
                    config, dims, built, optimizers, loss_fn, trace, accum, inputs, labels, target_device
                )
            trace.remove_hooks()
            trace.assign("parameters", params)
        return trace.result()


def _one_step(config, dims, built, optimizers, loss_fn, trace, accum, inputs, labels, target_device) -> None:
    parts, pipeline = built.parts, built.pipeline
    # The trainer's autocast on the target device (one GPU without FSDP); on fake tensors, which live on
    # the CPU, emulated by CPU autocast: both run matmuls and attention in the lower precision.
    dtype = autocast_dtype(config, dims, torch.device(target_device))

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
        with training_context(dims, built.options, cp_buffers=buffers, cp_seq_dims=[1, 1, *[0] * len(parts)]):
            if pipeline is not None:
                pipeline.step(inputs, labels)
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
    if built.options.float8_fsdp_all_gather and (
        config.quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp
    ):
        for part in parts:
            precompute_float8_scales(part)


@contextlib.contextmanager
def _no_automatic_gc():
    """The trainer collects garbage between steps, never during one (`wiring.gc_schedule`): what a step
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
        p.grad = torch.zeros_like(p)
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def _declare_stage_shapes(pipeline, built, dims, config) -> None:
    """Tell each pipeline stage the shapes it sends and receives: on a fake process group torch cannot
    infer them by asking the neighbouring stages, as it does in a real run."""
    from torch.distributed.pipelining._utils import _StageMeta, extract_tensor_metas

    t, p, args = config.training, config.parallelism, built.args
    mb = p.pipeline_parallel_microbatch_size
    seq = t.seq_len // dims.cp
    dtype = built.options.param_dtype if dims.fsdp_enabled else next(built.parts[0].parameters()).dtype
    split = dims.tp if dims.tp > 1 and built.options.sequence_parallel else 1
    device = torch.device("cpu")
    hidden = torch.empty(mb, seq // split, args.dim, dtype=dtype, device=device)
    tokens = torch.empty(mb, seq, dtype=torch.long, device=device)
    if dims.tp > 1 and built.options.loss_parallel:
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
