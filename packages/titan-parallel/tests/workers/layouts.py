"""Train the toy transformer under many parallel layouts, each beside its one-process reference.

Run under torchrun: `layouts.py OUT.json CASE [CASE ...]`. Every rank first trains an unparallelized
copy of the same model on the full batch (the one-process reference: no collectives involved),
then the same model through titan-parallel's public API. Rank 0 writes, per case, both runs'
losses and gradient norms plus facts showing the layout took effect; an exception is recorded as
the case's error and the next case runs.
"""

import copy
import json
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from clean_exit import exit_now
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from toy_transformer import SEQ, VOCAB, ToyTransformer, cross_entropy

from titan_parallel import (
    ContextParallelOptions,
    DataParallelOptions,
    Float8Training,
    MXTraining,
    ParallelConfigError,
    ParallelDims,
    ParallelOptions,
    PipelineOptions,
    TensorParallelOptions,
    apply_float8,
    apply_mx,
    apply_tp,
    build_pipeline,
    clip_grad_norm_,
    context_parallel_ctx,
    parallelize,
    precompute_float8_scales,
    training_context,
)

STEPS, GLOBAL_BATCH, MAX_NORM, LR = 5, 8, 0.3, 1e-2


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def reference(model: torch.nn.Module, data: list[torch.Tensor], chunks: int = 1) -> dict:
    """Plain single-process training; `chunks` > 1 accumulates over the per-rank slices instead."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = [], []
    for tokens in data:
        total = 0.0
        for part in tokens.chunk(chunks):
            loss = cross_entropy(model(part[:, :-1]), part[:, 1:]) / chunks
            loss.backward()
            total += loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "grad_norms": norms}


def run_layout(
    degrees: dict, options: ParallelOptions, n_layers: int = 2, ref_chunks: int = 1, tied: bool = False
) -> dict:
    dims = ParallelDims(**degrees, world_size=dist.get_world_size())
    dims.build_mesh("cpu")
    torch.manual_seed(0)
    model = ToyTransformer(n_layers, tied=tied)
    ref_model = copy.deepcopy(model)
    if options.float8:
        apply_float8(ref_model, recipe=options.float8.recipe)
    if options.mx:
        apply_mx(ref_model, recipe=options.mx.recipe, skip_fqns=options.mx.skip_fqns, device_type="cpu")
    data = batches()
    ref = reference(ref_model, data, ref_chunks)

    dp = dims.submesh("dp")
    dp_rank, dp_size = (dp.get_local_rank(), dp.size()) if dp else (0, 1)
    pipe, parts = parallel_parts(model, dims, options, GLOBAL_BATCH // dp_size)
    params = [p for part in parts for p in part.parameters()]
    opt = torch.optim.AdamW(params, lr=LR)
    facts: dict = {}
    losses, norms = [], []
    for step, tokens in enumerate(data):
        local = tokens.chunk(dp_size)[dp_rank]
        x, y = local[:, :-1].clone(), local[:, 1:].clone()
        ropes = [part.rope for part in parts]
        whole_x = x.clone()
        with training_context(
            dims,
            options,
            cp_buffers=[x, y, *ropes],
            cp_seq_dims=[1, 1, *[0] * len(ropes)],
            cp_no_restore=[x, y],
        ):
            if pipe is not None:
                loss = pipe.step(x, y)
            else:
                logits = model(x)
                if step == 0:
                    facts.update(after_forward_facts(model, logits, x))
                    # Without load balancing, rank 0 holds the head of each sequence in one piece.
                    facts["holds_sequence_head"] = torch.equal(x, whole_x[:, : x.shape[1]])
                loss = cross_entropy(logits, y)
                loss.backward()
        norm = clip_grad_norm_(params, MAX_NORM, pp_mesh=dims.submesh("pp"))
        opt.step()
        opt.zero_grad()
        if options.float8 and options.float8.fsdp_all_gather:
            precompute_float8_scales(model)
        loss = loss.detach().full_tensor() if isinstance(loss, DTensor) else loss.detach()
        loss_mesh = dims.submesh("dp_cp")
        if loss_mesh is not None:
            dist.all_reduce(loss, group=loss_mesh.get_group())
            loss = loss / loss_mesh.size()
        losses.append(loss.item())
        norms.append(norm.item())
    facts.update(layout_facts(dims, parts))
    facts["schedule"] = type(pipe.schedule).__name__ if pipe is not None else None
    return {"reference": ref, "parallel": {"losses": losses, "grad_norms": norms}, "facts": facts}


def parallel_parts(model, dims: ParallelDims, options: ParallelOptions, local_batch_size: int) -> tuple:
    """(the pipeline or None, the model parts this rank holds), parallelized through the public API."""
    if dims.pp > 1:
        pipe = build_pipeline(
            model,
            dims,
            options,
            loss_fn=cross_entropy,
            device=torch.device("cpu"),
            local_batch_size=local_batch_size,
        )
        return pipe, pipe.model_parts
    return None, [parallelize(model, dims, options)]


def after_forward_facts(model, logits, x) -> dict:
    block = model.layers["0"]
    return {
        "logits_dtype": str(logits.dtype),
        "local_seq_len": x.shape[1],
        # FSDP frees a block's gathered weights after forward only when it reshards.
        "block_param_sharded_after_forward": isinstance(block.attention.wq.weight, DTensor),
    }


def layout_facts(dims: ParallelDims, parts: list) -> dict:
    wq = next(p.attention.wq for part in parts for p in part.layers.values())
    facts = {
        "wq_placements": [str(p) for p in wq.weight.placements] if isinstance(wq.weight, DTensor) else None,
        "wq_local_type": type(wq.weight.to_local()).__name__ if isinstance(wq.weight, DTensor) else None,
        "wq_local_shape": list(
            wq.weight.to_local().shape if isinstance(wq.weight, DTensor) else wq.weight.shape
        ),
        "fsdp_module": isinstance(parts[0], FSDPModule),
        "linear_types": sorted(
            {type(m).__name__ for part in parts for m in part.modules() if "Linear" in type(m).__name__}
        ),
        "stage_blocks": [sorted(part.layers.keys()) for part in parts],
        "mesh_sizes": {
            n: (m.size() if m is not None else None)
            for n in ("dp", "dp_shard_cp", "dp_cp", "fsdp", "tp", "pp")
            for m in [dims.submesh(n)]
        },
        "fsdp_mesh_ndim": dims.submesh("fsdp").ndim if dims.submesh("fsdp") is not None else None,
        "tied": parts[0].output.weight is parts[0].tok_embeddings.weight
        if parts[0].output is not None and parts[0].tok_embeddings is not None
        else None,
    }
    if isinstance(parts[0], FSDPModule):
        facts["offload_policy"] = type(parts[0]._get_fsdp_state()._fsdp_param_group.offload_policy).__name__
    return facts


def refusals() -> dict:
    """Layouts that need a real mesh to be refused; each message is checked by the test."""
    messages = {}

    def attempt(name, fn):
        try:
            fn()
            messages[name] = None
        except ParallelConfigError as e:
            messages[name] = f"{type(e).__name__}: {e}"

    tp = ParallelDims(dp_shard=1, tp=2, world_size=2)
    tp.build_mesh("cpu")
    model = ToyTransformer()
    attempt("async_tp_on_cpu", lambda: apply_tp(model, tp.submesh("tp"), model.tp_plan(), async_tp=True))
    attempt(
        "pipeline_without_pp",
        lambda: build_pipeline(
            ToyTransformer(),
            tp,
            ParallelOptions(),
            loss_fn=cross_entropy,
            device=torch.device("cpu"),
            local_batch_size=4,
        ),
    )
    cp = ParallelDims(dp_shard=1, cp=2, world_size=2)
    cp.build_mesh("cpu")
    attempt("cp_without_buffers", lambda: training_context(cp, ParallelOptions()).__enter__())
    odd = torch.zeros(2, 6, dtype=torch.long)
    attempt("cp_seq_not_divisible", lambda: context_parallel_ctx(cp.submesh("cp"), [odd], [1]).__enter__())
    attempt(
        "cp_alltoall_with_own_attention",
        lambda: context_parallel_ctx(
            cp.submesh("cp"), [odd[:, :4]], [1], rotate_method="alltoall", models=[OwnAttention()]
        ).__enter__(),
    )
    ddp = ParallelDims(dp_replicate=2, dp_shard=1, world_size=2)
    ddp.build_mesh("cpu")
    attempt(
        "cpu_offload_without_sharding",
        lambda: parallelize(ToyTransformer(), ddp, data_parallel(cpu_offload=True)),
    )
    return {"facts": messages}


class OwnAttention(torch.nn.Module):
    """A model part that attends itself under context parallelism: it records the shards it is handed."""

    def __init__(self):
        super().__init__()
        self.shards = []

    def set_sequence_shard(self, shard) -> None:
        self.shards.append(shard)


def cp_failed_step() -> dict:
    """A step that raises inside context parallelism: SDPA and the sharded buffers come back all the same,
    and a model part attending itself got this rank's global positions (and the gathered ones), then None."""
    cp = ParallelDims(dp_shard=1, cp=2, world_size=2)
    cp.build_mesh("cpu")
    sdpa, rope, part = F.scaled_dot_product_attention, torch.arange(8.0), OwnAttention()
    seen = {}
    try:
        with context_parallel_ctx(cp.submesh("cp"), [rope], [0], models=[part]):
            shard = part.shards[0]
            seen = {"positions": shard.positions.tolist(), "all_positions": shard.all_positions().tolist()}
            raise RuntimeError("step failed")
    except RuntimeError:
        pass
    return {
        "facts": {
            "sdpa_restored": F.scaled_dot_product_attention is sdpa,
            "buffer_restored": rope.tolist() == [float(i) for i in range(8)],
            "shard_withdrawn": len(part.shards) == 2 and part.shards[1] is None,
            **seen,
        }
    }


def schedule(name: str, **extra) -> ParallelOptions:
    return ParallelOptions(pipeline=PipelineOptions(schedule=name, **extra))


def data_parallel(**settings) -> ParallelOptions:
    return ParallelOptions(data_parallel=DataParallelOptions(**settings))


CASES = {
    # 2 ranks
    "fsdp": lambda: run_layout({"dp_shard": 2}, ParallelOptions()),
    "fsdp_reshard_always": lambda: run_layout({"dp_shard": 2}, data_parallel(reshard_after_forward="always")),
    "fsdp_reshard_never": lambda: run_layout({"dp_shard": 2}, data_parallel(reshard_after_forward="never")),
    "fsdp_bf16_params": lambda: run_layout({"dp_shard": 2}, data_parallel(param_dtype=torch.bfloat16)),
    "fsdp_cpu_offload": lambda: run_layout({"dp_shard": 2}, data_parallel(cpu_offload=True)),
    "ddp": lambda: run_layout({"dp_replicate": 2, "dp_shard": 1}, ParallelOptions()),
    "tp_sp_loss_parallel": lambda: run_layout({"dp_shard": 1, "tp": 2}, ParallelOptions()),
    "tp_tied": lambda: run_layout({"dp_shard": 1, "tp": 2}, ParallelOptions(), tied=True),
    "tp_plain": lambda: run_layout(
        {"dp_shard": 1, "tp": 2},
        ParallelOptions(tensor_parallel=TensorParallelOptions(sequence_parallel=False, loss_parallel=False)),
    ),
    "cp_allgather": lambda: run_layout(
        {"dp_shard": 1, "cp": 2},
        ParallelOptions(context_parallel=ContextParallelOptions(rotate_method="allgather")),
    ),
    "cp_alltoall": lambda: run_layout(
        {"dp_shard": 1, "cp": 2},
        ParallelOptions(context_parallel=ContextParallelOptions(rotate_method="alltoall")),
    ),
    "cp_no_load_balance": lambda: run_layout(
        {"dp_shard": 1, "cp": 2}, ParallelOptions(context_parallel=ContextParallelOptions(load_balancer=None))
    ),
    "pp_1F1B": lambda: run_layout({"dp_shard": 1, "pp": 2}, schedule("1F1B"), n_layers=4),
    "pp_GPipe": lambda: run_layout({"dp_shard": 1, "pp": 2}, schedule("GPipe"), n_layers=4),
    "pp_Interleaved1F1B": lambda: run_layout(
        {"dp_shard": 1, "pp": 2}, schedule("Interleaved1F1B"), n_layers=4
    ),
    "pp_LoopedBFS": lambda: run_layout({"dp_shard": 1, "pp": 2}, schedule("LoopedBFS"), n_layers=4),
    "pp_InterleavedZeroBubble": lambda: run_layout(
        {"dp_shard": 1, "pp": 2}, schedule("InterleavedZeroBubble"), n_layers=4
    ),
    "pp_ZBVZeroBubble": lambda: run_layout({"dp_shard": 1, "pp": 2}, schedule("ZBVZeroBubble"), n_layers=4),
    "pp_DualPipeV": lambda: run_layout({"dp_shard": 1, "pp": 2}, schedule("DualPipeV"), n_layers=4),
    "pp_split_points_microbatch_2": lambda: run_layout(
        {"dp_shard": 1, "pp": 2},
        schedule("1F1B", split_points=("layers.1",), microbatch_size=2),
        n_layers=3,
    ),
    "float8_tensorwise_fsdp_all_gather": lambda: run_layout(
        {"dp_shard": 2},
        ParallelOptions(float8=Float8Training("tensorwise", fsdp_all_gather=True)),
        ref_chunks=2,
    ),
    "float8_rowwise_fsdp": lambda: run_layout(
        {"dp_shard": 2}, ParallelOptions(float8=Float8Training("rowwise")), ref_chunks=2
    ),
    "float8_tensorwise_tp": lambda: run_layout(
        {"dp_shard": 1, "tp": 2}, ParallelOptions(float8=Float8Training("tensorwise"))
    ),
    "float8_rowwise_tp": lambda: run_layout(
        {"dp_shard": 1, "tp": 2}, ParallelOptions(float8=Float8Training("rowwise"))
    ),
    "mx_emulated_fsdp": lambda: run_layout(
        {"dp_shard": 2}, ParallelOptions(mx=MXTraining("mxfp8_emulated")), ref_chunks=2
    ),
    "refusals": refusals,
    "cp_failed_step": cp_failed_step,
    # 4 ranks
    "hsdp": lambda: run_layout({"dp_replicate": 2, "dp_shard": 2}, ParallelOptions()),
    "fsdp_tp": lambda: run_layout({"dp_shard": 2, "tp": 2}, ParallelOptions()),
    "fsdp_tp_tied": lambda: run_layout({"dp_shard": 2, "tp": 2}, ParallelOptions(), tied=True),
    "fsdp_cp": lambda: run_layout({"dp_shard": 2, "cp": 2}, ParallelOptions()),
    "hsdp_cp": lambda: run_layout({"dp_replicate": 2, "dp_shard": 1, "cp": 2}, ParallelOptions()),
    "pp_fsdp": lambda: run_layout({"dp_shard": 2, "pp": 2}, schedule("Interleaved1F1B"), n_layers=4),
    "pp_tp": lambda: run_layout({"dp_shard": 1, "pp": 2, "tp": 2}, schedule("1F1B"), n_layers=4),
}


def main(out_path: str, names: list[str]) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    results = {}
    for name in names:
        try:
            results[name] = CASES[name]()
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        dist.barrier()
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()  # no rank tears the group down while another still uses it
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    exit_now()  # see clean_exit
