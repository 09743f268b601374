"""A Hugging Face export written by the ranks that hold the model, with no whole-model gather on one rank.

Every block (`layers.N`) and every top-level tensor is one unit of export, given to one rank that holds
it (balanced by bytes; under pipeline parallelism only the stage's ranks hold a block). Sharded tensors
are unsharded one at a time among the ranks of their mesh; only the owner keeps the result. Each rank
then maps its own units through the caller's adapter (the tensors it does not own stand in as meta
tensors, which cost nothing: the mappings are per block) and writes its own safetensors shards of at
most `max_shard_bytes`. Rank 0 writes `config.json`, the extra files, Titan's own tensors (`titan.*`, state
the format cannot hold) in `TITAN_STATE_FILE` and, last, the index that names every shard. So a rank's host
memory grows by its share of the model, not by the model.

Titan's own tensors stay out of the index's `weight_map` (listed under `TITAN_WEIGHT_MAP` instead): vLLM
loads every tensor of the files that map names and refuses one its model class lacks, where transformers
only reports it (tests/test_hf_export_vllm.py).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from titan_ckpt.collectives import barrier, group_rank, raise_on_every_rank
from titan_ckpt.errors import CheckpointError
from titan_ckpt.hf_safetensors import (
    TITAN_ONLY_PREFIX,
    TITAN_STATE_FILE,
    TITAN_WEIGHT_MAP,
    HFStateDictAdapter,
    kept_dtypes,
    unheld_state,
    unshare,
)
from titan_ckpt.step_folders import HF_INDEX

logger = logging.getLogger(__name__)

_BLOCK = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _unit(name: str) -> str:
    """The unit of export a tensor belongs to: its block, or the tensor itself outside the blocks."""
    m = _BLOCK.search(name)
    return f"layers.{m.group(1)}" if m else name


def _world(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _all_gather(value: Any, group: dist.ProcessGroup | None) -> list[Any]:
    if _world(group) == 1:
        return [value]
    every = [None] * _world(group)
    dist.all_gather_object(every, value, group=group)
    return every


def assign_owners(specs: list[list[tuple[str, tuple[int, ...], str, int]]]) -> dict[str, int]:
    """unit -> the rank that exports it: the holder with the fewest bytes so far, largest units first.

    `specs[rank]` lists (name, full shape, dtype, bytes) of the tensors that rank holds. Every rank
    computes the same answer from the same gathered specs."""
    unit_bytes: dict[str, int] = {}
    holders: dict[str, set[int]] = {}
    for rank, tensors in enumerate(specs):
        for name, _, _, nbytes in tensors:
            unit = _unit(name)
            holders.setdefault(unit, set()).add(rank)
            if rank == min(holders[unit]):
                unit_bytes[unit] = unit_bytes.get(unit, 0) + nbytes
    load = [0] * len(specs)
    owners = {}
    for unit in sorted(unit_bytes, key=lambda u: (-unit_bytes[u], u)):
        rank = min(holders[unit], key=lambda r: (load[r], r))
        owners[unit] = rank
        load[rank] += unit_bytes[unit]
    return owners


def plan_shards(files: list[list[tuple[str, int]]], max_shard_bytes: int) -> list[list[list[str]]]:
    """Per rank, its tensors (name, bytes) packed in order into shards of at most `max_shard_bytes`
    (a larger tensor alone); numbered across ranks in rank order."""
    plan = []
    for tensors in files:
        shards: list[list[str]] = []
        size = 0
        for name, nbytes in tensors:
            if not shards or (shards[-1] and size + nbytes > max_shard_bytes):
                shards.append([])
                size = 0
            shards[-1].append(name)
            size += nbytes
        plan.append(shards)
    return plan


def _gather_owned(state: Mapping[str, Any], owners: dict[str, int], rank: int) -> dict[str, torch.Tensor]:
    """The full tensors of the units this rank owns; sharded ones are unsharded one at a time (every
    rank of their mesh takes part, in state-dict order) and dropped at once where not owned."""
    owned = {}
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            continue
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        if owners[_unit(name)] == rank:
            owned[name] = tensor.detach().cpu()
        del tensor
    return owned


def _mapped_own_share(
    adapter: HFStateDictAdapter,
    owned: dict[str, torch.Tensor],
    specs: list[list[tuple[str, tuple[int, ...], str, int]]],
) -> dict[str, torch.Tensor]:
    """This rank's tensors in Hugging Face names and layout: the whole model goes through the mapping,
    the tensors of other ranks as meta tensors, and only what came from real tensors is kept."""
    full: dict[str, torch.Tensor] = {}
    for tensors in specs:
        for name, shape, dtype, _ in tensors:
            if name not in full:
                full[name] = owned.get(name)
                if full[name] is None:
                    full[name] = torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
    return {k: v for k, v in adapter.to_hf(full).items() if v.device.type != "meta"}


def _spec(name: str, tensor: torch.Tensor) -> tuple[str, tuple[int, ...], str, int]:
    return (
        name,
        tuple(tensor.shape),
        str(tensor.dtype).removeprefix("torch."),
        tensor.numel() * tensor.element_size(),
    )


def write_hf_export(
    folder: Path,
    state: Mapping[str, Any],
    adapter: HFStateDictAdapter,
    config: dict,
    *,
    dtype: torch.dtype,
    lossy: bool = False,
    unheld_effect: Callable[[], tuple[int, int] | None] | None = None,
    max_shard_bytes: int,
    extra_files: Mapping[str, bytes | Path] | None = None,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Write the model `state` (this rank's tensors, sharded or not) as a Hugging Face folder, from
    every rank of `group` together. Tensors are cast to `dtype`, except those the adapter's
    `hf_keep_dtype` names. State the adapter's `hf_unheld_state` names is written under
    `TITAN_ONLY_PREFIX`; where it is not neutral (zero) the export stops saying so, unless `lossy`.
    `unheld_effect` gives this rank's (changed, total) count of what that state changes on a sample
    (routings of the last training batch), or None, for that message."""
    if max_shard_bytes < 1:
        raise CheckpointError(f"checkpoint: max_shard_bytes must be >= 1, got {max_shard_bytes}")
    rank = group_rank(group)
    specs = _all_gather([_spec(n, t) for n, t in state.items() if isinstance(t, torch.Tensor)], group)
    owners = assign_owners(specs)
    owned = _gather_owned(state, owners, rank)
    unheld = {k: v for k, v in owned.items() if k.endswith(unheld_state(adapter))}
    _refuse_unheld_state(unheld, lossy, group, unheld_effect)
    keep = kept_dtypes(adapter)
    problem, mine = None, {}
    try:
        mine = _mapped_own_share(adapter, owned, specs)
        mine = {k: v if k.endswith(keep) else v.to(dtype) for k, v in mine.items()}
    except Exception as err:
        problem = f"checkpoint: the Hugging Face weight mapping failed on rank {rank}: {err}"
    # Small (a vector per MoE layer): gathered to rank 0, which writes them in a file of their own.
    titan_only = {TITAN_ONLY_PREFIX + k: v.detach().cpu() for k, v in unheld.items()}
    titan_only = {k: v for ranks in _all_gather(titan_only, group) for k, v in ranks.items()}
    del unheld
    del owned
    raise_on_every_rank(problem, group)
    # A tensor the mapping makes on every rank (a neutral buffer) is written by the lowest one.
    files = _all_gather([(k, v.numel() * v.element_size()) for k, v in mine.items()], group)
    seen: set[str] = set()
    for r, tensors in enumerate(files):
        files[r] = [(k, n) for k, n in tensors if not (k in seen or seen.add(k))]
    plan = plan_shards(files, max_shard_bytes)
    count = sum(len(shards) for shards in plan)
    first = sum(len(shards) for shards in plan[:rank]) + 1
    weight_map = {}
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for index, names in enumerate(plan[rank], start=first):
            file = folder / f"model-{index:05d}-of-{count:05d}.safetensors"
            save_file(unshare({n: mine.pop(n) for n in names}), str(file), metadata={"format": "pt"})
        for r, shards in enumerate(plan):
            start = sum(len(s) for s in plan[:r]) + 1
            for index, names in enumerate(shards, start=start):
                weight_map |= dict.fromkeys(names, f"model-{index:05d}-of-{count:05d}.safetensors")
    except Exception as err:
        problem = f"checkpoint: writing Hugging Face shards to {folder} failed on rank {rank}: {err}"
    mine.clear()
    raise_on_every_rank(problem, group)
    if rank == 0:
        try:
            _write_index_and_config(
                folder, weight_map, sum(n for f in files for _, n in f), config, extra_files, titan_only
            )
        except Exception as err:
            problem = f"checkpoint: writing the Hugging Face index to {folder} failed: {err}"
    raise_on_every_rank(problem, group)
    barrier(group)


def _refuse_unheld_state(
    unheld: dict[str, torch.Tensor],
    lossy: bool,
    group: dist.ProcessGroup | None,
    effect: Callable[[], tuple[int, int] | None] | None = None,
) -> None:
    """Stop the export (every rank) where state the format cannot hold is not zero, naming the layers,
    the largest value and, where `effect` measured it on the last training batch,
    the share of routings it changes; with `lossy`, say it once and go on."""
    measured = _all_gather(effect() if effect is not None else None, group)
    found = {}
    for ranks in _all_gather({k: v.abs().max().item() for k, v in unheld.items() if v.numel()}, group):
        found |= {k: x for k, x in ranks.items() if x > 0}
    if not found:
        return
    by_kind: dict[str, list[str]] = {}
    for name in sorted(found, key=lambda n: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", n)]):
        m = _BLOCK.search(name)
        kind = name[m.end() :] if m else name
        by_kind.setdefault(kind, []).append(m.group(1) if m else "-")
    what = "; ".join(f"{kind} of layers {', '.join(layers)}" for kind, layers in by_kind.items())
    line = (
        f"checkpoint: the Hugging Face format cannot hold the trained {what} (largest |value| "
        f"{max(found.values()):.3g}, where zero is neutral): the exported model routes tokens to other experts"
    )
    counts = [m for m in measured if m is not None]
    if counts and sum(t for _, t in counts):
        changed, total = sum(c for c, _ in counts), sum(t for _, t in counts)
        line += (
            f" ({100 * changed / total:.1f}% of the last training batch's token routings pick other experts)"
        )
    if lossy:
        if group_rank(group) == 0:
            logger.warning("%s; exported anyway (Titan keeps it under '%s' keys)", line, TITAN_ONLY_PREFIX)
        return
    raise CheckpointError(
        f"{line}; set checkpoint.hf_export_lossy = true to export anyway (Titan keeps it under "
        f"'{TITAN_ONLY_PREFIX}' keys for its own re-import)"
    )


def _write_index_and_config(
    folder: Path,
    weight_map: dict[str, str],
    total: int,
    config: dict,
    extra_files: Mapping[str, bytes | Path] | None,
    titan_only: dict[str, torch.Tensor],
) -> None:
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if titan_only:
        save_file(unshare(titan_only), str(folder / TITAN_STATE_FILE), metadata={"format": "pt"})
    for name, content in (extra_files or {}).items():
        if isinstance(content, Path):
            shutil.copyfile(content, folder / name)
        else:
            (folder / name).write_bytes(content)
    # The index is written last: it is what marks the folder as a complete Hugging Face checkpoint.
    index: dict[str, Any] = {
        "metadata": {"total_size": total},
        "weight_map": dict(sorted(weight_map.items())),
    }
    if titan_only:
        index[TITAN_WEIGHT_MAP] = dict.fromkeys(sorted(titan_only), TITAN_STATE_FILE)
    (folder / HF_INDEX).write_text(json.dumps(index, indent=2))
