"""torchrun worker: titan-train's Trainer once per layout, one after another in one process group.

`layout_matrix.py LAYOUTS.json OUT`: LAYOUTS.json maps layout names to `titan-train` CLI overrides
(or to {"argv": overrides, "dump": folder}, for runs in order on one dump folder, as a torchtitan
feature case makes them: see tests/test_torchtitan_features.py).
The group is joined once, as `titan-train` joins it. Each layout is then parsed and trained as the
CLI does it (config, seq_len check, Trainer with its refusals, collective timeout, train), writing
OUT/NAME/metrics.jsonl. After its last step, each rank holding a distinct piece of the model
(coordinate 0 on every mesh dim but pp) writes those parameters, gathered whole, to
OUT/NAME/weights_rank<R>.pt. Then the process groups its device mesh created are destroyed, with
DTensor's sharding caches (they hand an equal mesh's cached results, and so its groups, to the next
layout) and compiled graphs. A layout refused with a user error records its one-line message.
Rank 0 writes OUT/results.json: per layout, the refusal or facts showing the layout took effect, the
process groups alive after it, and its seconds.
"""

import contextlib
import functools
import gc
import json
import sys
import time
from pathlib import Path

import tiny_moe_flavor  # noqa: F401  (registers qwen3 tiny_moe, gpt_oss tiny: this script's folder is on sys.path)
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import _clear_sharding_prop_cache
from torch.distributed.tensor.parallel import ParallelStyle

from titan_models.qwen3_5.linear_attention import GatedDeltaNet
from titan_parallel import dequantized, moe_layers_of
from titan_train.cli import USER_ERRORS, plan_run, train_joined
from titan_train.config import load_job_config
from titan_train.distributed import init_distributed, shutdown
from titan_train.registry import get_model_family, register_flavor
from titan_train.step.gc_schedule import libraries_frozen
from titan_train.trainer import Trainer

# The Llama 3 debug model cut to 2 layers, and to 4 for schedules with two stages per pipeline rank.
_LLAMA3 = get_model_family("llama3")
register_flavor("llama3", "debug_2_layers", _LLAMA3.args_for("debugmodel", n_layers=2))
register_flavor("llama3", "debug_4_layers", _LLAMA3.args_for("debugmodel", n_layers=4))
# Block-causal attention over the packed documents, by SDPA's boolean mask and by variable-length attention.
register_flavor(
    "llama3",
    "debug_2_layers_block_causal",
    _LLAMA3.args_for("debugmodel", n_layers=2, attn_mask_type="block_causal"),
)
register_flavor("llama3", "debug_2_layers_varlen", _LLAMA3.args_for("debugmodel_varlen_attn", n_layers=2))
# Qwen3.5's debug models (dense, dense on packed documents, MoE) cut to one block of each kind: full attention first, so block 0 answers
# the facts' questions about `wq` as every family's does, then a Gated DeltaNet linear-attention block.
_QWEN3_5, _QWEN3_5_TYPES = get_model_family("qwen3_5"), ("full_attention", "linear_attention")
for _flavor in ("debugmodel", "debugmodel_flex_attn", "debugmodel_moe"):
    register_flavor(
        "qwen3_5", f"{_flavor}_2_layers", _QWEN3_5.args_for(_flavor, n_layers=2, layer_types=_QWEN3_5_TYPES)
    )


def train_layout(argv: list[str], info) -> Trainer:
    """What `titan-train` does between joining the group and leaving it: its own two steps, the plan
    (every check of the config and layout) and the training on the joined group."""
    with contextlib.ExitStack() as closing:
        return train_joined(plan_run(load_job_config(argv, check_paths=True)), info, closing)


def write_weights(trainer: Trainer, path: Path) -> None:
    """The parameters this rank holds, whole, if no rank before it in its pipeline stage holds them too."""
    state = {}
    for part in trainer.model_parts:
        state.update(get_model_state_dict(part, options=StateDictOptions(full_state_dict=True)))
    mesh = trainer.dims.mesh
    coordinate = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate(), strict=True))
    if all(c == 0 for name, c in coordinate.items() if name != "pp"):
        # A QLoRA base is written as the values it trains against (torch.load takes no NF4 tensors).
        torch.save({k: dequantized(v.detach()).cpu() for k, v in state.items()}, path)


def release_groups_since(groups_before: set) -> None:
    """Destroy the process groups created since `groups_before`, and every cache that may hold them."""
    for group in set(dist.distributed_c10d._world.pg_map) - groups_before:
        dist.destroy_process_group(group)
    _clear_sharding_prop_cache()
    torch._dynamo.reset()


def tp_style(module: torch.nn.Module) -> str | None:
    """The tensor-parallel style that hooked `module`'s input: its class, read from the hook's closure."""
    for hook in module._forward_pre_hooks.values():
        for cell in hook.__closure__ or ():
            value = cell.cell_contents
            if isinstance(value, ParallelStyle):  # PrepareModuleInput and kin hook a bound method
                return type(value).__name__
            if isinstance(value, functools.partial):  # Colwise/Rowwise hook their static input function
                return value.func.__qualname__.split(".")[0]
    return None


def facts(trainer: Trainer) -> dict:
    """What rank 0 sees of the layout: degrees, stages, sharding, wrapped blocks, linear types."""
    parts = trainer.model_parts
    blocks = [block for part in parts for block in part.layers.values()]
    wq = blocks[0].attention.wq.weight
    linear_types = {
        type(m).__name__ for part in parts for m in part.modules() if "Linear" in type(m).__name__
    }
    return {
        "degrees": {k: v for k, v in trainer.dims.degrees.items() if v > 1},
        "grad_accum_steps": trainer.grad_accum_steps,
        "schedule": type(trainer.pipeline.schedule).__name__ if trainer.pipeline else None,
        "stage_blocks": [sorted(part.layers.keys()) for part in parts],
        "fsdp": isinstance(parts[0], FSDPModule),
        "loss_parallel": trainer.dims.tp > 1 and trainer.parallel_options.tensor_parallel.loss_parallel,
        "cp_rotate_method": trainer.parallel_options.context_parallel.rotate_method
        if trainer.dims.cp > 1
        else None,
        "cp_load_balancer": trainer.parallel_options.context_parallel.load_balancer
        if trainer.dims.cp > 1
        else None,
        "wq_placements": [str(p) for p in wq.placements] if isinstance(wq, DTensor) else None,
        "wq_local_type": type(wq.to_local()).__name__ if isinstance(wq, DTensor) else None,
        "tp_styles": [tp_style(blocks[0].attention.wq), tp_style(blocks[0].attention)],
        "checkpointed_blocks": sum("forward" in vars(block) for block in blocks),
        "compiled_blocks": sum(getattr(block, "_compiled_call_impl", None) is not None for block in blocks),
        # An MoE block is compiled around its experts: its attention on its own.
        "compiled_attentions": sum(
            getattr(block.attention, "_compiled_call_impl", None) is not None for block in blocks
        ),
        "linear_types": sorted(linear_types),
        "attn_backend": trainer.model_parts[0].args.attn_backend,
        "optimizer_in_backward": type(trainer.optimizers).__name__ == "BackwardStepOptimizers",
        "optimizer": type(trainer.optimizers.optimizers[0]).__name__,
        "loader_workers": trainer.loader.num_workers,
        "experts": expert_facts(trainer),
        "shared_experts": shared_expert_facts(trainer),
        "lora_placements": lora_facts(blocks[0]),
        "mtp": mtp_facts(trainer),
        "linear_attention": linear_attention_facts(blocks),
    }


def linear_attention_facts(blocks: list) -> dict | None:
    """How the first Gated DeltaNet layer rank 0 holds is split: its fused q/k/v projection's and its
    per-head decay's placements and local shapes (None: no such layer)."""
    layers = [block.attention for block in blocks if isinstance(block.attention, GatedDeltaNet)]
    if not layers:
        return None
    facts = {}
    for name, param in (("in_proj_qkv", layers[0].in_proj_qkv.weight), ("A_log", layers[0].A_log)):
        split = isinstance(param, DTensor)
        facts[f"{name}_placements"] = [str(p) for p in param.placements] if split else None
        facts[f"{name}_local_shape"] = list(param.to_local().shape if split else param.shape)
    return facts


def mtp_facts(trainer: Trainer) -> dict | None:
    """The multi-token-prediction depths the parts hold, the first one's experts' local w1 shape (its
    shards under FSDP or EP) and how its projection is split (under TP); None for a model without them."""
    parts = [part for part in trainer.model_parts if getattr(part, "mtp", None) is not None]
    depths = {k: d for part in parts for k, d in part.mtp.layers.items()}
    if not depths:
        return None
    depth = next(iter(depths.values()))
    w1, eh_proj = depth.block.moe.experts.w1, depth.eh_proj.weight
    split = isinstance(w1, DTensor)
    return {
        "layers": sorted(depths),
        "eh_proj_placements": [str(p) for p in eh_proj.placements] if isinstance(eh_proj, DTensor) else None,
        "w1_placements": [str(p) for p in w1.placements] if split else None,
        "w1_local_shape": list(w1.to_local().shape if split else w1.shape),
    }


def lora_facts(block) -> dict | None:
    """How the first block's query and output projections' LoRA adapters are split (None: not DTensors)."""
    adapters = {
        f"{name}.{side}": getattr(getattr(linear, side, None), "weight", None)
        for name, linear in (("wq", block.attention.wq), ("wo", block.attention.wo))
        for side in ("lora_A", "lora_B")
    }
    if not any(isinstance(w, DTensor) for w in adapters.values()):
        return None
    return {key: [str(p) for p in w.placements] for key, w in adapters.items() if isinstance(w, DTensor)}


def expert_facts(trainer: Trainer) -> dict | None:
    """How the first MoE layer's experts are split: ep, etp, and its first weight's (w1, gpt-oss's
    mlp1_weight) mesh dims, placements and local shape."""
    layers = [layer for part in trainer.model_parts for layer in moe_layers_of(part).values()]
    if not layers:
        return None
    w1 = next(layers[0].experts.parameters())
    split = isinstance(w1, DTensor)
    return {
        "ep": trainer.dims.ep,
        "etp": trainer.dims.etp,
        "w1_mesh_dims": list(w1.device_mesh.mesh_dim_names) if split else None,
        "w1_placements": [str(p) for p in w1.placements] if split else None,
        "w1_local_shape": list(w1.to_local().shape if split else w1.shape),
    }


def shared_expert_facts(trainer: Trainer) -> dict | None:
    """How the first MoE layer's shared expert is split: w1's and w2's placements and local shapes."""
    layers = [layer for part in trainer.model_parts for layer in moe_layers_of(part).values()]
    if not layers or layers[0].shared_experts is None:
        return None
    facts = {}
    for name in ("w1", "w2"):
        weight = getattr(layers[0].shared_experts, name).weight
        split = isinstance(weight, DTensor)
        facts[f"{name}_placements"] = [str(p) for p in weight.placements] if split else None
        facts[f"{name}_local_shape"] = list(weight.to_local().shape if split else weight.shape)
    return facts


def main(layouts_json: Path, out: Path) -> None:
    info = init_distributed(300)
    with libraries_frozen():  # as titan-train runs: each row's collection walks only what the row built
        results = run_rows(json.loads(layouts_json.read_text()), info, out)
    if info.rank == 0:
        (out / "results.json").write_text(json.dumps(results, indent=1))
    shutdown()


def run_rows(rows: dict, info, out: Path) -> dict:
    """Each row trained in turn on the joined group: its facts or its refusal, and what it cost."""
    results = {}
    for name, overrides in rows.items():
        dump = out / name
        if isinstance(overrides, dict):  # a run with its own dump folder (runs of one case share it)
            overrides, dump = overrides["argv"], Path(overrides["dump"])
        groups_before = set(dist.distributed_c10d._world.pg_map)
        start, cpu_start = time.perf_counter(), time.process_time()
        try:
            trainer = train_layout([*overrides, "--job.dump_folder", str(dump)], info)
            write_weights(trainer, dump / f"weights_rank{info.rank}.pt")
            # Only rank 0's facts are written; another rank may hold no block that answers them (a pipeline
            # stage of Gated DeltaNet blocks has no `wq`).
            result = {"facts": facts(trainer) if info.rank == 0 else {}}
        except USER_ERRORS as err:
            result = {"refused": f"{type(err).__name__}: {err}"}
        trainer = None
        gc.collect()
        dist.barrier()
        release_groups_since(groups_before)
        result["groups_after"] = len(dist.distributed_c10d._world.pg_map)
        result["seconds"] = time.perf_counter() - start
        result["cpu_seconds"] = time.process_time() - cpu_start
        results[name] = result
    return results


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
