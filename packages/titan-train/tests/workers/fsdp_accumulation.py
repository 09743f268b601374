"""torchrun worker: FSDP over the ranks trains three steps with local batch 4, then with 2 x 2 accumulation,
then validates on a set that gives rank 0 several times more batches than rank 1, then on batches whose
source goes down on rank 1 only.

Counts FSDP's gradient reductions by wrapping (and calling) the function FSDP uses for them, to show
that accumulation skips the reduce-scatter of every micro-batch but the last.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard import _fsdp_param_group

from titan_ckpt import Checkpointer
from titan_data import SourceUnavailable
from titan_train.config import load_job_config
from titan_train.distributed import init_distributed
from titan_train.faults.data_outage import DataUnavailable, stop_on_data_outage
from titan_train.objectives.validation import Validator
from titan_train.plan import resolve
from titan_train.trainer import Trainer

SMALL = [
    "--training.seq_len",
    "32",
    "--training.steps",
    "3",
    "--activation_checkpoint.mode",
    "none",
    "--metrics.log_freq",
    "1",
    "--metrics.disable_color_printing",
    "--lr_scheduler.warmup_steps",
    "2",
    "--optimizer.lr",
    "3e-3",
    "--training.dataloader.num_streams",
    "2",
]
RUNS = {
    "local_batch_4": ["--training.local_batch_size", "4"],
    "local_batch_2_accumulate_2": ["--training.local_batch_size", "2", "--training.global_batch_size", "8"],
}


def count_reductions() -> list[int]:
    calls = [0]
    reduce = _fsdp_param_group.foreach_reduce

    def counted(*args, **kwargs):
        calls[0] += 1
        return reduce(*args, **kwargs)

    _fsdp_param_group.foreach_reduce = counted
    return calls


def uneven_validation_set(folder: Path) -> Path:
    """Documents are dealt round-robin to the ranks' streams: long ones to rank 0, short ones to rank 1."""
    path = folder / "validation.txt"
    words = "the quick brown fox jumps over the lazy dog".split()
    lines = [" ".join(words * (60 if i % 2 == 0 else 6)) for i in range(8)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _logged(metrics: Path, key: str) -> list[float]:
    return [json.loads(line)[key] for line in metrics.read_text().splitlines()]


def _read_if_written(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def validation_outage(trainer: Trainer, rank: int, folder: Path) -> dict:
    """Validate `trainer`'s FSDP model on batches whose source is down on rank 1 at its second batch (rank
    0 has three): every rank must stop together and save step 2 together (the one line naming rank 1)."""

    def batches():
        for i in range(3):
            if rank == 1 and i == 1:
                raise SourceUnavailable("dataset: http://127.0.0.1:9/validation.json.gz stopped answering")
            yield (torch.randint(0, 2000, (2, 32)), torch.randint(0, 2000, (2, 32)))

    validator = Validator(batches, trainer.objective.validation_loss, device=trainer.device, freq=1, steps=-1)
    checkpointer = Checkpointer(folder, {"train_state": trainer.state})
    try:
        with stop_on_data_outage(2, checkpointer):
            validator.validate(trainer.model_parts)
    except DataUnavailable as stop:
        return {"line": str(stop), "saved": checkpointer.step_folder(2).is_dir()}
    return {"line": None}


def main(out: Path) -> None:
    info = init_distributed(300)
    calls = count_reductions()
    validation_set = uneven_validation_set(out.parent)
    runs = {
        **RUNS,
        "uneven_validation": [
            "--training.local_batch_size",
            "4",
            "--training.steps",
            "2",
            "--validation.enable",
            "--validation.freq",
            "2",
            "--validation.steps",
            "-1",
            "--validation.dataset",
            "text",
            "--validation.dataset_path",
            str(validation_set),
            "--validation.seq_len",
            "32",
            "--validation.local_batch_size",
            "2",
        ],
    }
    results = {}
    for name, flags in runs.items():
        before = calls[0]
        trainer = Trainer(
            resolve(
                load_job_config([*SMALL, *flags, "--job.dump_folder", str(out.parent / name)]),
                info.world_size,
                "cpu",
            ),
            info,
        )
        losses = trainer.train()
        results[name] = {
            "losses": losses,
            "grad_norms": _logged(out.parent / name / "metrics.jsonl", "grad_norm"),
            "reductions": calls[0] - before,
            "grad_accum_steps": trainer.grad_accum_steps,
            "fsdp": isinstance(trainer.model_parts[0], FSDPModule),
            "validation": _read_if_written(out.parent / name / "validation.jsonl"),
        }
    results["validation_outage"] = validation_outage(trainer, info.rank, out.parent / "validation_outage")
    if info.rank == 0:
        out.write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
