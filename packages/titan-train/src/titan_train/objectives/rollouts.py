"""Rollouts for learning from rewards: a step's completions of its prompts, from the titan engine (the
policy's own KV-cache generator, in the training processes) or from a recorded file, and the log every run
writes of them (`dump_folder/rollouts/rank<R>.jsonl`, one line per completion, which `grpo.replay_rollouts`
reads back).

The titan engine runs on the policy's current weights: under FSDP each rank gathers the whole model once
(`whole_weights`), generates its own prompts, and frees the gathered weights before training. Under expert
parallelism (without tensor parallelism) it decodes the same way on the policy itself, its experts left split
over the ep ranks: their forwards trade tokens by all-to-all, so the ep ranks step together until all their
completions end (`lockstep`, over every rank: the experts' FSDP gathers span other ranks than their ep group).
Under tensor parallelism (`WholeCopy`) each rank gathers every weight whole into an unparallelised copy of the
model and decodes on it with no collective, as one process does; the copy is dropped before training. Each
completion samples from its own generator, seeded by the run's seed, the step, its prompt and its place in the
prompt's group (`completion_seeds`), so a resumed run, or one on other ranks, draws the same completions; the
tensor-parallel ranks, which share their prompts, must draw the same ones (`check_same_over`).
"""

from __future__ import annotations

import contextlib
import json
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from titan_models.generation import SamplingParams, generate
from titan_parallel import fill_whole
from titan_train.errors import ConfigError


@dataclass
class Completions:
    """A step's completions, `num_generations` per prompt in prompt order: token ids ending with the id that
    ended them (an end-of-turn id), or cut at max_completion_length (`truncated`); from an engine that
    reports them (vllm), the log-prob it sampled each token at."""

    ids: list[list[int]]
    truncated: list[bool]
    logprobs: list[list[float]] | None = None


@contextlib.contextmanager
def whole_weights(parts: list[nn.Module]) -> Iterator[None]:
    """Every FSDP-sharded module of `parts` gathered whole on this rank, resharded on exit."""
    # FSDP picks its root at the first forward; generation calls blocks' submodules, some FSDP modules of their
    # own under EP (the experts), which would otherwise each become a root before the policy ever ran one.
    for part in parts:
        if isinstance(part, FSDPModule):
            part._get_fsdp_state()._lazy_init()
    sharded = [m for part in parts for m in part.modules() if isinstance(m, FSDPModule)]
    for module in sharded:
        module.unshard()
    try:
        yield
    finally:
        for module in sharded:
            module.reshard()


class WholeCopy:
    """Generation's model under tensor or expert parallelism: `build()` makes the model unparallelised on the
    meta device (`titan_train.plan.one_process_plan`), and each generation fills it with the policy's weights
    gathered whole (`titan_parallel.fill_whole`, collectives over every rank), then lets it go."""

    def __init__(self, build: Callable[[], nn.Module]):
        self.build = build

    @contextlib.contextmanager
    def of(self, parts: list[nn.Module]) -> Iterator[nn.Module]:
        copy = fill_whole(self.build(), parts[0])
        try:
            yield copy
        finally:
            del copy


def decodes_on_copy(tp: int) -> bool:
    """Whether the titan engine decodes on an unparallelised copy: under tensor parallelism, whose split heads
    and rows the KV cache does not hold; FSDP and expert parallelism decode on the policy's own modules."""
    return tp > 1


def lockstep(group: dist.ProcessGroup, device: torch.device) -> Callable[[bool], bool]:
    """`generate`'s `all_done` over `group`: whether every rank's completions have ended (one all-reduce a
    decode step), so ranks whose forwards hold all-to-alls run every forward together."""

    def all_done(mine: bool) -> bool:
        flag = torch.tensor([int(mine)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        return bool(flag.item())

    return all_done


@contextlib.contextmanager
def generating_model(parts: list[nn.Module], copy: WholeCopy | None) -> Iterator[nn.Module]:
    """The whole model to generate with: the policy itself, its FSDP shards gathered, or `copy` filled."""
    if copy is not None:
        with copy.of(parts) as model:
            yield model
        return
    with whole_weights(parts):
        yield parts[0]


def check_same_over(completions: Completions, group: dist.ProcessGroup | None, device: torch.device) -> None:
    """Refuse completions that differ between the ranks of `group` (the tensor-parallel ranks: the same
    prompts, the same seed, the same weights), before they train on sequences that do not match."""
    if group is None:
        return
    digest = zlib.crc32(json.dumps(completions.ids).encode())
    local = torch.tensor([digest], dtype=torch.long, device=device)
    every = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, local, group=group)
    if len({int(d) for d in every}) > 1:
        raise RuntimeError(
            "grpo: the tensor-parallel ranks generated different completions of the same prompts; their "
            "sampling seeds or gathered weights differ (each must seed with completion_seeds of the same prompts)"
        )


def generation_eos_ids(folder: str | Path | None) -> list[int]:
    """The EOS ids a Hugging Face folder's `generation_config.json` (else `config.json`) names, where it has one."""
    for name in ("generation_config.json", "config.json"):
        path = Path(folder) / name if folder else None
        if path is not None and path.is_file():
            ids = json.loads(path.read_text()).get("eos_token_id")
            if ids is not None:
                return [ids] if isinstance(ids, int) else [int(i) for i in ids]
    return []


def completion_seeds(seed: int, step: int, indices: Sequence[int], num_generations: int) -> tuple[int, ...]:
    """The seed of each completion (the titan engine's `SamplingParams.row_seeds`, vLLM's request seeds), of the
    run's seed, the step, its prompt and its place among the prompt's completions: the same after a resume and
    at any rank count, so ranks that split the step's prompts draw what one process draws."""
    return tuple(
        zlib.crc32(f"{seed}:{step}:{i}:{k}".encode()) for i in indices for k in range(num_generations)
    )


def titan_completions(
    model: nn.Module,
    prompts: list[list[int]],
    num_generations: int,
    params: SamplingParams,
    pad_id: int,
    all_done: Callable[[bool], bool] | None = None,
) -> Completions:
    """Each prompt continued `num_generations` times by `model` (whole, in eval mode), as one batch; with
    `all_done` (`lockstep`) until every rank stepping with this one is done too."""
    batch = [p for p in prompts for _ in range(num_generations)]
    out = generate(model, batch, params, pad_id=pad_id, all_done=all_done)
    ids = [
        tokens + ([end] if end is not None else [])
        for tokens, end in zip(out.tokens, out.end_ids, strict=True)
    ]
    return Completions(ids, [reason == "length" for reason in out.finish_reasons])


class RolloutLog:
    """This rank's rollouts, a JSON line per completion, appended as steps go. A resumed run first drops the
    lines of steps after the one it resumes from (an interrupted run may have logged a step it never saved),
    so the file holds each step's rollouts once."""

    def __init__(self, dump: Path, rank: int):
        self.path = dump / "rollouts" / f"rank{rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def resume_from(self, step: int) -> None:
        if not self.path.exists():
            return
        lines = self.path.read_text().splitlines()
        kept = [line for line in lines if line and json.loads(line)["step"] <= step]
        if len(kept) != len(lines):
            self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, step: int, rows: list[dict]) -> None:
        with self.path.open("a") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **row}) + "\n")


class RecordedRollouts:
    """Completions read back from rollout logs (a file, or a folder of `*.jsonl`), by (step, prompt index)."""

    def __init__(self, path: str | Path):
        path = Path(path)
        files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
        if not files:
            raise ConfigError(f"config: grpo.replay_rollouts = {str(path)!r} holds no .jsonl rollout file")
        self.by_prompt: dict[tuple[int, int], list[dict]] = {}
        for file in files:
            for n, line in enumerate(file.read_text().splitlines(), start=1):
                try:
                    row = json.loads(line)
                    key = (int(row["step"]), int(row["prompt_index"]))
                    row["completion_ids"] = [int(i) for i in row["completion_ids"]]
                except (ValueError, KeyError, TypeError) as err:
                    raise ConfigError(
                        f"config: grpo.replay_rollouts: {file}:{n} is not a rollout line with step, "
                        f"prompt_index and completion_ids ({err})"
                    ) from None
                self.by_prompt.setdefault(key, []).append(row)

    def completions(
        self,
        step: int,
        indices: Sequence[int],
        prompts: list[list[int]],
        num_generations: int,
        ends: set[int],
    ) -> Completions:
        """The recorded completions of step `step`'s prompts; ConfigError naming the first that was not recorded
        for that step, or whose recorded prompt ids differ from the data's."""
        ids: list[list[int]] = []
        for index, prompt in zip(indices, prompts, strict=True):
            rows = self.by_prompt.get((step, index), [])
            if len(rows) != num_generations:
                raise ConfigError(
                    f"config: grpo.replay_rollouts holds {len(rows)} completions of prompt {index} at step {step}, "
                    f"not grpo.num_generations = {num_generations}: replay the run with its data and settings"
                )
            if any("prompt_ids" in r and r["prompt_ids"] != prompt for r in rows):
                raise ConfigError(
                    f"config: grpo.replay_rollouts: prompt {index} at step {step} was recorded with other token "
                    "ids than the data renders now (another tokenizer, template or max_prompt_length)"
                )
            ids.extend(r["completion_ids"] for r in rows)
        return Completions(ids, [not c or c[-1] not in ends for c in ids])
