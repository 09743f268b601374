"""Train the toy MoE under expert-parallel layouts, each beside its one-process reference.

Run under torchrun: `moe_layouts.py OUT.json CASE [CASE ...]`. Every rank first trains an
unparallelized copy on the full batch (no collectives), then the same model through titan-parallel's
public API. Each step also sums the experts' token counts over the data ranks and moves the expert
bias by them (auxiliary-loss-free balancing), so the routing of later steps depends on that sum.
Rank 0 writes per case both runs' losses and gradient norms, the largest weight difference after
the run, and facts showing the layout took effect.
"""

import contextlib
import copy
import json
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from clean_exit import exit_now
from layouts import parallel_parts
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from toy_moe import ToyMoE
from toy_transformer import SEQ, VOCAB, cross_entropy

from titan_parallel import (
    ActivationCheckpointing,
    Compile,
    ParallelConfigError,
    ParallelDims,
    ParallelOptions,
    PipelineOptions,
    clip_grad_norm_,
    moe_layers_of,
    parallelize,
    sum_tokens_per_expert,
    training_context,
)

# SGD, not Adam: Adam divides each gradient by its own magnitude, so rounding noise in a tiny gradient
# becomes a visible weight difference; with SGD the weights after the run compare the gradients.
STEPS, GLOBAL_BATCH, MAX_NORM, LR, BIAS_RATE = 4, 8, 0.3, 0.5, 1e-2


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


@torch.no_grad()
def balance(parts: list[torch.nn.Module], mesh) -> list[list[float]]:
    """Move each expert bias toward under-used experts by the counts summed over `mesh`; zero the counts."""
    layers = {fqn: m for part in parts for fqn, m in moe_layers_of(part).items()}
    counts = sum_tokens_per_expert(layers, mesh)
    for layer, count in zip(layers.values(), counts, strict=True):
        layer.expert_bias.add_(BIAS_RATE * torch.sign(count.mean() - count))
        layer.tokens_per_expert.zero_()
    return dict(zip(layers, counts.tolist(), strict=True))


def reference(model: torch.nn.Module, data: list[torch.Tensor]) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms, counts = [], [], []
    for tokens in data:
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        counts.append(balance([model], None))
        losses.append(loss.item())
    return {"losses": losses, "grad_norms": norms, "tokens_per_expert": counts}


class AllToAllCount(TorchDispatchMode):
    """Counts the all-to-alls that run. Entered outside the checkpointed blocks, it does not see one
    that selective checkpointing answers from its saved outputs in the recompute."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.ops._c10d_functional.all_to_all_single.default
        return func(*args, **(kwargs or {}))


def run_layout(degrees: dict, options: ParallelOptions | None = None, n_layers: int = 2) -> dict:
    options = options or ParallelOptions()
    dims = ParallelDims(**degrees, world_size=dist.get_world_size())
    dims.build_mesh("cpu")
    torch.manual_seed(0)
    model = ToyMoE(n_layers)
    ref_model = copy.deepcopy(model)
    data = batches()
    ref = reference(ref_model, data)

    dp = dims.submesh("dp")
    dp_rank, dp_size = (dp.get_local_rank(), dp.size()) if dp else (0, 1)
    pipe, parts = parallel_parts(model, dims, options, GLOBAL_BATCH // dp_size)
    params = [p for part in parts for p in part.parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    losses, norms, counts = [], [], []
    # Checkpointing every block (fully or per op) runs each MoE forward twice, so the model counts each
    # token twice (as torchtitan's does); the sign-based bias update is the same either way.
    ac = options.activation_checkpoint
    every_block = ac.mode == "full" or (ac.mode == "selective" and ac.selective_every is None)
    recount = 2 if every_block else 1
    all_to_all = AllToAllCount()
    counting = (
        contextlib.nullcontext() if options.compile.enabled else all_to_all
    )  # compile refuses a dispatch mode
    for step, tokens in enumerate(data):
        local = tokens.chunk(dp_size)[dp_rank]
        x, y = local[:, :-1].clone(), local[:, 1:].clone()
        ropes = [part.rope for part in parts]
        with (
            training_context(
                dims,
                options,
                cp_buffers=[x, y, *ropes],
                cp_seq_dims=[1, 1, *[0] * len(ropes)],
                cp_no_restore=[x, y],
            ),
            counting,
        ):
            if pipe is not None:
                loss = pipe.step(x, y)
            else:
                loss = cross_entropy(model(x), y)
                loss.backward()
        norm = clip_grad_norm_(params, MAX_NORM, pp_mesh=dims.submesh("pp"))
        opt.step()
        opt.zero_grad()
        summed = balance(parts, dims.submesh("dp_cp"))  # the MoE layers this pipeline stage holds
        counts.append(
            all(summed[k] == [recount * c for c in ref["tokens_per_expert"][step][k]] for k in summed)
        )
        loss = loss.detach().full_tensor() if isinstance(loss, DTensor) else loss.detach()
        if dims.submesh("dp_cp") is not None:
            dist.all_reduce(loss, group=dims.submesh("dp_cp").get_group())
            loss = loss / dims.submesh("dp_cp").size()
        losses.append(loss.item())
        norms.append(norm.item())
    agree = torch.tensor(float(all(counts)))
    dist.all_reduce(agree, op=dist.ReduceOp.MIN)
    return {
        "reference": ref,
        "parallel": {"losses": losses, "grad_norms": norms},
        "tokens_per_expert_as_one_process": bool(agree.item()),
        "weight_diff": weight_diff(parts, ref_model),
        "facts": {**facts(dims, parts), "all_to_all_per_step": all_to_all.calls / STEPS},
    }


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def weight_diff(parts: list, ref_model: torch.nn.Module) -> float:
    """Largest |parallel - reference| / max|reference| over every weight, across all ranks."""
    ref = dict(ref_model.named_parameters())
    worst = torch.zeros(())
    for part in parts:
        for name, p in part.named_parameters():
            r = ref[name].detach()
            d = (full(p.detach()) - r).abs().max() / r.abs().max()
            worst = torch.maximum(worst, d)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def facts(dims: ParallelDims, parts: list) -> dict:
    experts = [layer.experts for part in parts for layer in moe_layers_of(part).values()]
    w1 = experts[0].w1 if experts else None
    out = {
        "mesh_sizes": {
            n: (m.size() if m is not None else None)
            for n in ("ep", "efsdp", "etp")
            for m in [dims.submesh(n)]
        },
    }
    moe = next(iter(moe_layers_of(parts[-1]).values()), None)
    out["compiled_router"] = moe is not None and moe.router._compiled_call_impl is not None
    if isinstance(w1, DTensor):
        out["w1_placements"] = [str(p) for p in w1.placements]
        out["w1_mesh_dims"] = list(w1.device_mesh.mesh_dim_names)
        out["w1_local_shape"] = list(w1.to_local().shape)
    return out


def dcp_reshard(folder: str) -> dict:
    """Save the experts at ep2 and load them at ep4 and at ep1: the same full weights each time."""
    world = dist.get_world_size()

    def build(ep: int, seed: int) -> torch.nn.Module:
        dims = ParallelDims(dp_shard=world, ep=ep, world_size=world)
        dims.build_mesh("cpu")
        torch.manual_seed(seed)
        return parallelize(ToyMoE(), dims, ParallelOptions())

    saved = build(2, seed=0)
    dcp.save(saved.state_dict(), checkpoint_id=folder)
    want = {k: full(v).clone() for k, v in saved.state_dict().items()}
    equal = {}
    for ep in (4, 1):
        model = build(ep, seed=1)
        state = model.state_dict()
        dcp.load(state, checkpoint_id=folder)
        placements = str(state["layers.1.moe.experts.w1"].placements)
        equal[f"ep{ep}"] = [placements, all(torch.equal(full(v), want[k]) for k, v in state.items())]
    return {"facts": equal}


# Every case runs on 4 ranks, so one launch covers them all.
CASES = {
    "ep2_fsdp4": lambda: run_layout({"dp_shard": 4, "ep": 2}),
    "ep4": lambda: run_layout({"dp_shard": 4, "ep": 4}),
    "ep2_etp2": lambda: run_layout({"dp_shard": 2, "tp": 2, "ep": 2, "etp": 2}),
    "ep4_borrowing_tp": lambda: run_layout({"dp_shard": 2, "tp": 2, "ep": 4, "etp": 1}),
    "tp2_experts": lambda: run_layout({"dp_shard": 2, "tp": 2}),
    "hsdp_ep2": lambda: run_layout({"dp_replicate": 2, "dp_shard": 2, "ep": 2}),
    "ep2_cp2": lambda: run_layout({"dp_shard": 2, "cp": 2, "ep": 2}),
    "ep2_pp2": lambda: run_layout(
        {"dp_shard": 2, "pp": 2, "ep": 2}, ParallelOptions(pipeline=PipelineOptions(schedule="1F1B")), 4
    ),
    # Per-op checkpointing with the experts' own FSDP unit (on one rank) inside each block; all-to-alls kept.
    "hsdp_ep2_ac_op": lambda: run_layout(
        {"dp_replicate": 2, "dp_shard": 2, "ep": 2},
        ParallelOptions(activation_checkpoint=ActivationCheckpointing(mode="selective")),
    ),
    "ep2_ac_full_compile": lambda: run_layout(
        {"dp_shard": 4, "ep": 2},
        ParallelOptions(
            activation_checkpoint=ActivationCheckpointing(mode="full"),
            compile=Compile(enabled=True, backend="aot_eager"),
        ),
    ),
}


def refusals() -> dict:
    """Expert layouts refused once the model is seen; each message is checked by the test."""
    dims = ParallelDims(dp_shard=4, ep=4, world_size=dist.get_world_size())
    dims.build_mesh("cpu")
    messages = {}
    for name, options in {
        "plain": ParallelOptions(),
    }.items():
        try:
            model = ToyMoE()
            if name == "plain":  # 6 experts do not split over 4 ranks
                model.layers["1"].moe.experts.w1.data = torch.zeros(6, 32, 32)
            parallelize(model, dims, options)
            messages[name] = None
        except ParallelConfigError as e:
            messages[name] = str(e)
    return {"facts": messages}


def main(out_path: str, names: list[str]) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    results = {}
    for name in names:
        try:
            start = time.perf_counter()
            if name == "dcp_reshard":
                results[name] = dcp_reshard(str(Path(out_path).parent / "ckpt"))
            elif name == "refusals":
                results[name] = refusals()
            else:
                results[name] = CASES[name]()
            results[name]["seconds"] = time.perf_counter() - start
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        dist.barrier()
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    exit_now()  # see clean_exit
