"""One training step of a config traced for one rank: the model and layout it configures, on fake tensors.

The step is the trainer's: zero the gradients, forward and backward over every micro-batch (or the
pipeline schedule), clip the gradient norm, step the optimizer. The optimizer state is created
first (one optimizer step on zero gradients), as it exists in every step but the first. On fake tensors
(torch's `FakeTensorMode`) nothing is allocated or computed; with `fake=False` the same code runs on
real tensors, which is how the tests check the trace against what a real step holds.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from titan_parallel import blocks_of, clip_grad_norm_, precompute_float8_scales, training_context
from titan_parallel.cuda_kernel_memory import use_cuda_kernel_memory
from titan_parallel.memory_trace import MemoryTrace, TraceResult
from titan_train import build
from titan_train.hf_interop import model_args
from titan_train.registry import get_model_spec


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
    finally:
        dist.destroy_process_group()


def trace_step(
    config: Any,
    world_size: int,
    *,
    fake: bool = True,
    n_layers: int | None = None,
    target_device: str = "cuda",
) -> TraceResult:
    """Trace one step of `config` on this rank of the process group that is already initialised.

    `n_layers` builds the model with that many blocks (the estimate traces a few and scales);
    `target_device` picks the dtypes the real run would use (CPU keeps float32 where GPUs use bf16).
    Fake tensors live on the CPU; real ones (`fake=False`) on `target_device`, so that on a GPU the
    same tracker follows what the real step holds there.
    """
    device = torch.device("cpu" if fake else target_device)
    spec = get_model_spec(config.model.name)
    dims = build.build_parallel_dims(config, world_size)
    dims.build_mesh(device.type)
    dp_mesh = dims.submesh("dp")
    accum = build.gradient_accumulation_steps(config, dp_mesh.size() if dp_mesh else 1)
    trace = MemoryTrace()

    configured_loss = build.build_loss_fn(config, spec)

    def labelled_loss(logits, labels):
        trace.label(("loss",))
        return configured_loss(logits, labels)

    spec = replace(spec, loss_fn=labelled_loss)
    args = model_args(config)  # the flavor, or the checkpoint's config.json for `from_hf`
    tokenizer = SimpleNamespace(eos_id=args.eos_id, vocab_size=0)
    built = build.build_model(
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
        optimizers = [build.build_optimizer(config, part) for part in parts]
        t = config.training
        inputs = torch.randint(0, args.vocab_size, (t.local_batch_size, t.seq_len), device=device)
        labels = torch.randint(0, args.vocab_size, (t.local_batch_size, t.seq_len), device=device)
        params = [p for part in parts for p in part.parameters()]
        loss_fn = spec.loss_fn if accum == 1 else (lambda x, y: spec.loss_fn(x, y) / accum)
        _create_optimizer_state(params, optimizers)
        with trace:
            trace.track(params, "parameters")
            trace.track([s for o in optimizers for s in _state_tensors(o)], "optimizer state")
            trace.track([b for part in parts for b in part.buffers()] + [inputs, labels])
            for i, part in enumerate(parts):
                trace.watch_blocks(i, blocks_of(part).values())
            _one_step(config, dims, built, optimizers, loss_fn, trace, accum, inputs, labels, target_device)
            trace.remove_hooks()
            trace.assign("parameters", params)
        return trace.result()


def _one_step(config, dims, built, optimizers, loss_fn, trace, accum, inputs, labels, target_device) -> None:
    parts, pipeline = built.parts, built.pipeline
    # The trainer's autocast on the target device (one GPU without FSDP); on fake tensors, which live on
    # the CPU, emulated by CPU autocast: both run matmuls and attention in the lower precision.
    dtype = build.autocast_dtype(config, dims, torch.device(target_device))

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
        buffers = [inputs, labels, *(part.freqs_cis for part in parts)]
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
        inputs = (tokens,) if stage.is_first else (hidden,)
        outputs = (logits,) if stage.is_last else (hidden,)
        in_grads = (None,) if stage.is_first else (hidden,)
        stage._user_meta = _StageMeta(
            inputs=extract_tensor_metas(inputs),
            outputs=extract_tensor_metas(outputs),
            input_grads=extract_tensor_metas(in_grads, allow_none=True),
            output_grads=extract_tensor_metas(outputs, allow_none=True),
        )
        stage._mesh_cache.update_from_tensors(outputs)
