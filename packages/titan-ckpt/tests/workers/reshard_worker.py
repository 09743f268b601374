"""Checkpoints across layouts on 2 ranks (run under torchrun; rank 0 writes a JSON report to argv[1]).

Saves with FSDP on 2 ranks, then loads into 1 rank and into tensor parallel 2; also covers async
saves across ranks, a rank failing mid-write, a key missing on one rank only, Hugging Face
export from FSDP imported into TP, float8 block-quantised Hugging Face files into FSDP and TP, and gpt-oss's
MXFP4 expert weights into each way of splitting a (experts, rows, columns) tensor. Uses raw torch parallelism
(this package may not import titan-parallel).
"""

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from titan_ckpt import (
    Checkpointer,
    CheckpointError,
    LastSavePolicy,
    LoadPolicy,
    ModelState,
    OptimizerState,
    SavePolicy,
)

FULL = StateDictOptions(full_state_dict=True)
FULL_OPTIM = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(16, 32)
        self.w2 = nn.Linear(32, 16)
        self.out = nn.Linear(16, 8)

    def forward(self, x):
        return self.out(self.w2(torch.relu(self.w1(x))))


class Streams:
    """A data loader's state whose keys are unique per rank (the streams this rank reads)."""

    def __init__(self, owned: list[int]):
        self.positions = dict.fromkeys(owned, 0)

    def state_dict(self) -> dict[str, Any]:
        return {f"stream_{j}": p for j, p in self.positions.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.positions = {int(k.split("_")[1]): v for k, v in state.items()}


class Unpicklable:
    """A state that cannot be written on this rank: pickling a lambda fails inside DCP's writer."""

    def __init__(self, rank: int):
        self.rank = rank

    def state_dict(self) -> dict[str, Any]:
        return {f"obj_{self.rank}": (lambda: 0) if self.rank == 1 else 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class RenameAdapter:
    """Hugging Face names for the toy model; full plain tensors in and out."""

    def to_hf(self, sd):
        return {f"model.{k}": v for k, v in sd.items()}

    def from_hf(self, hf):
        return {k.removeprefix("model."): v for k, v in hf.items()}

    def hf_config(self):
        return {"model_type": "toy"}


def quantized_files(tensors: dict, block: int) -> tuple[dict, dict]:
    """(safetensors content with each matrix as float8 e4m3 plus its `_scale_inv` per block x block, the
    matrices those files mean: fp8 times its block's scale), written here element by block."""
    files, dequantised = {}, {}
    for name, t in tensors.items():
        if t.ndim != 2:
            files[name] = dequantised[name] = t
            continue
        rows, cols = -(-t.shape[0] // block), -(-t.shape[1] // block)
        scale = torch.empty(rows, cols)
        fp8 = torch.empty(t.shape, dtype=torch.float8_e4m3fn)
        for i in range(rows):
            for j in range(cols):
                part = (slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block))
                scale[i, j] = t[part].abs().max() / 448
                fp8[part] = (t[part] / scale[i, j]).to(torch.float8_e4m3fn)
        files[name], files[f"{name}_scale_inv"] = fp8, scale
        back = fp8.to(torch.float32)
        for i in range(rows):
            for j in range(cols):
                back[i * block : (i + 1) * block, j * block : (j + 1) * block] *= scale[i, j]
        dequantised[name] = back
    return files, dequantised


# FP4 E2M1 magnitudes by the code's low three bits (bit 3 is the sign), as the OCP MX specification lists them.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def mxfp4_meaning(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What MXFP4 `blocks` (E, rows, groups, 16) and `scales` (E, rows, groups) mean, value by value: each
    byte holds two codes (low nibble first), each group of 32 values shares 2 ** (scale - 127)."""
    e, rows, groups, _ = blocks.shape
    out = torch.empty(e, rows, groups * 32, dtype=torch.float64)
    for index in torch.cartesian_prod(*(torch.arange(n) for n in blocks.shape)).tolist():
        i, r, g, b = index
        byte = int(blocks[i, r, g, b])
        for half, code in enumerate((byte & 0x0F, byte >> 4)):
            sign = -1.0 if code & 8 else 1.0
            out[i, r, g * 32 + 2 * b + half] = sign * E2M1[code & 7] * 2.0 ** (int(scales[i, r, g]) - 127)
    return out


class Experts(nn.Module):
    """One expert weight in transformers' layout (experts, columns, rows), split by `placement` or whole."""

    def __init__(self, mesh, shape, placement):
        super().__init__()
        whole = torch.zeros(shape)
        self.w = nn.Parameter(whole if placement is None else distribute_tensor(whole, mesh, [placement]))


def load_hf(model: nn.Module, folder: Path, run_folder: Path) -> None:
    """Start a run of `model` from the Hugging Face files in `folder` (the toy's names, `RenameAdapter`)."""
    Checkpointer(
        run_folder,
        {"model": ModelState([model])},
        loading=LoadPolicy(initial_load_path=folder, initial_load_in_hf=True),
        hf_adapter=RenameAdapter(),
    ).load()


def fsdp_model(mesh, seed=0):
    torch.manual_seed(seed)
    model = Toy()
    for layer in (model.w1, model.w2, model.out):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def tp_model(mesh, seed):
    torch.manual_seed(seed)
    return parallelize_module(Toy(), mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})


def states(model, optimizer, owned):
    return {
        "model": ModelState([model]),
        "optimizer": OptimizerState([model], [optimizer]),
        "dataloader": Streams(owned),
    }


def train(
    model, optimizer, streams: Streams, steps: int, rank: int, ckpt: Checkpointer | None = None
) -> None:
    for _ in range(steps):
        gen = torch.Generator().manual_seed(100 * rank + sum(streams.positions.values()))
        model(torch.randn(4, 16, generator=gen)).pow(2).mean().backward()
        if ckpt is not None:
            ckpt.wait_for_staging()
        optimizer.step()
        optimizer.zero_grad()
        for j in streams.positions:
            streams.positions[j] += 1


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(
        (x.float() - y.float()).abs().max().item() for x, y in zip(a.values(), (b[k] for k in a), strict=True)
    )


def optimizer_tensors(model, optimizer) -> dict:
    sd = get_optimizer_state_dict(model, optimizer, options=FULL_OPTIM)
    return {k: v for k, v in sd.items() if k.startswith("state.") and isinstance(v, torch.Tensor)}


def error_on_every_rank(action) -> list[str]:
    try:
        action()
        message = "no error"
    except CheckpointError as err:
        message = str(err)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, message)
    return every


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    root = Path(out_path).parent / "checkpoints"
    report: dict[str, Any] = {}

    # A: FSDP on 2 ranks trains, then saves (each rank writes its shards and its own stream).
    model = fsdp_model(mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    saved = states(model, optimizer, [rank])
    train(model, optimizer, saved["dataloader"], 3, rank)
    Checkpointer(root / "a", saved).save(3)
    reference = get_model_state_dict(model, options=FULL)
    reference_optim = optimizer_tensors(model, optimizer)
    report["fsdp_is_sharded"] = (
        isinstance(model.w1.weight, DTensor) and model.w1.weight.to_local().shape[0] == 16
    )

    # B: one rank (a one-rank group holding only rank 0) loads it into a plain module.
    alone = dist.new_group([0])
    if rank == 0:
        plain = Toy()
        plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
        one = states(plain, plain_optimizer, [0, 1])
        Checkpointer(root / "a", one, process_group=alone).load()
        report["one_rank_weights_max_diff"] = max_diff(plain.state_dict(), reference)
        report["one_rank_optimizer_max_diff"] = max_diff(
            optimizer_tensors(plain, plain_optimizer), reference_optim
        )
        report["one_rank_streams"] = one["dataloader"].positions
    dist.barrier()

    # C: tensor parallel on 2 ranks loads the same files.
    tp = tp_model(mesh, seed=5)
    tp_optimizer = torch.optim.AdamW(tp.parameters(), lr=1e-2)
    Checkpointer(root / "a", states(tp, tp_optimizer, [rank])).load()
    report["tp_is_sharded"] = tp.w1.weight.placements[0].is_shard(0) and tp.w2.weight.placements[0].is_shard(
        1
    )
    report["tp_weights_max_diff"] = max_diff(get_model_state_dict(tp, options=FULL), reference)
    report["tp_optimizer_max_diff"] = max_diff(optimizer_tensors(tp, tp_optimizer), reference_optim)

    # D: async saves across ranks hold the state of their step while training continues.
    report["async_max_diff"] = {}
    for mode in ("async", "async_with_pinned_mem"):
        ckpt = Checkpointer(root / mode, saved, saving=SavePolicy(interval=1, async_mode=mode))
        ckpt.save(4)
        at_save = get_model_state_dict(model, options=FULL)
        train(model, optimizer, saved["dataloader"], 2, rank, ckpt)
        ckpt.close()
        fresh = fsdp_model(mesh, seed=9)
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        Checkpointer(root / mode, states(fresh, fresh_optimizer, [rank])).load()
        report["async_max_diff"][mode] = max_diff(get_model_state_dict(fresh, options=FULL), at_save)

    # E: rank 1 fails while writing: no rank publishes the step, and the next start skips it.
    Checkpointer(root / "e", saved).save(1)
    failing = Checkpointer(root / "e", {**saved, "extra": Unpicklable(rank)})
    report["failed_save_errors"] = error_on_every_rank(lambda: failing.save(2))
    report["failed_save_folders"] = sorted(p.name for p in (root / "e").iterdir())
    dist.barrier()
    report["after_failure_load"] = (
        Checkpointer(root / "e", saved, loading=LoadPolicy(exclude_from_loading=["dataloader"])).load().step
    )
    report["after_failure_folders"] = sorted(p.name for p in (root / "e").iterdir())

    # F: a key only rank 1 asks for is missing: both ranks fail with the same message, none hangs.
    other = fsdp_model(mesh, seed=3)
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=1e-2)
    mismatched = Checkpointer(root / "a", states(other, other_optimizer, [rank if rank == 0 else 5]))
    report["mismatch_errors"] = error_on_every_rank(mismatched.load)

    # G: Hugging Face export from FSDP on 2 ranks, imported into tensor parallel.
    hf_ckpt = Checkpointer(
        root / "g",
        saved,
        last_save=LastSavePolicy(model_only=True, in_hf=True),
        hf_adapter=RenameAdapter(),
    )
    hf_ckpt.maybe_save(6, last_step=True)
    exported = get_model_state_dict(model, options=FULL)
    tp_hf = tp_model(mesh, seed=6)
    tp_hf_optimizer = torch.optim.AdamW(tp_hf.parameters(), lr=1e-2)
    Checkpointer(
        root / "g_run",
        states(tp_hf, tp_hf_optimizer, [rank]),
        loading=LoadPolicy(initial_load_path=root / "g" / "step-6", initial_load_in_hf=True),
        hf_adapter=RenameAdapter(),
    ).load()
    report["hf_files"] = sorted(p.name for p in (root / "g" / "step-6").iterdir())
    report["hf_tp_max_diff"] = max_diff(get_model_state_dict(tp_hf, options=FULL), exported)

    # H: float8 block-quantised Hugging Face files (12x12 blocks: partial at the edges) into FSDP and TP.
    fp8_folder = root / "h"
    reference = {}
    for name, tensor in Toy().state_dict().items():
        reference[f"model.{name}"] = torch.randn(tensor.shape, generator=torch.Generator().manual_seed(9))
    files, dequantised = quantized_files(reference, 12)
    if rank == 0:
        fp8_folder.mkdir()
        save_file(files, str(fp8_folder / "model.safetensors"))
        quantization = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [12, 12]}
        (fp8_folder / "config.json").write_text(json.dumps({"quantization_config": quantization}))
    dist.barrier()
    expected = {k.removeprefix("model."): v for k, v in dequantised.items()}
    report["hf_fp8_max_diff"] = {}
    for layout, fp8_model in (("fsdp", fsdp_model(mesh, seed=7)), ("tp", tp_model(mesh, seed=8))):
        load_hf(fp8_model, fp8_folder, root / f"h_{layout}")
        report["hf_fp8_max_diff"][layout] = max_diff(get_model_state_dict(fp8_model, options=FULL), expected)
    report["hf_fp8_quantisation_error"] = max_diff(dequantised, reference)

    # I: gpt-oss's MXFP4 expert weights (4 experts, 6 rows, 3 groups of 32 columns), every code and a range of
    # exponents, into the whole tensor, experts split (FSDP, expert parallelism), columns split mid-group
    # (48 of 96) and rows split (expert tensor parallelism): each rank keeps its part of the decoded values.
    mx_folder = root / "i"
    gen = torch.Generator().manual_seed(11)
    blocks = torch.randint(0, 256, (4, 6, 3, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(117, 137, (4, 6, 3), dtype=torch.uint8, generator=gen)
    if rank == 0:
        mx_folder.mkdir()
        save_file({"model.w_blocks": blocks, "model.w_scales": scales}, str(mx_folder / "model.safetensors"))
        (mx_folder / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "mxfp4"}}))
    dist.barrier()
    # Stored (E, rows, cols); transformers' layout, which the import gives, is (E, cols, rows).
    meant = mxfp4_meaning(blocks, scales).transpose(1, 2)
    report["hf_mxfp4_max_diff"] = {}
    for layout, placement in (
        ("whole", None),
        ("experts", Shard(0)),
        ("columns", Shard(1)),
        ("rows", Shard(2)),
    ):
        experts = Experts(mesh, meant.shape, placement)
        load_hf(experts, mx_folder, root / f"i_{layout}")
        got = experts.w.full_tensor() if isinstance(experts.w, DTensor) else experts.w.detach()
        local = experts.w.to_local() if isinstance(experts.w, DTensor) else experts.w
        report["hf_mxfp4_max_diff"][layout] = (got.double() - meant).abs().max().item()
        report.setdefault("hf_mxfp4_local_shapes", {})[layout] = list(local.shape)

    if rank == 0:
        Path(out_path).write_text(json.dumps(report, indent=1))
    dist.barrier()  # no rank tears the group down while another still uses it
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
