"""torchrun worker: DPO under FSDP over the ranks, once with a frozen-copy reference and once with the
reference's log-probs precomputed (their pass's batches dealt over the ranks, one rank repeating a batch
to meet the other's forwards); writes each run's metrics and how many frozen copies were built.

argv: the tiny model's folder, the pairs file, the output folder."""

import json
import sys
from pathlib import Path

from tiny_llama import from_hf_flags

import titan_train.objectives.preference as preference_objective
import titan_train.trainer as trainer_module
from titan_train.config import load_job_config
from titan_train.distributed import init_distributed
from titan_train.plan import resolve


def main(folder: Path, data: Path, out: Path) -> None:
    info = init_distributed(300)
    built = []
    real_build = preference_objective.build_reference
    preference_objective.build_reference = lambda *a: built.append(copy := real_build(*a)) or copy
    results = {}
    for reference in ("copy", "precompute"):
        dump = out / reference
        flags = [
            *from_hf_flags(folder, dump),
            "--training.dataset", "preference",
            "--training.dataset_path", str(data),
            "--training.seq_len", "128",
            "--training.steps", "3",
            "--training.local_batch_size", "3",  # 8 pairs, batches of 3: 3 batches over 2 ranks
            "--sft.packing", "false",
            "--optimizer.lr", "3e-3",
            "--preference.beta", "0.5",
            "--preference.reference", reference,
            "--parallelism.data_parallel_shard_degree", "2",
        ]  # fmt: skip
        trainer = trainer_module.Trainer(resolve(load_job_config(flags), info.world_size, "cpu"), info)
        trainer.train()
        results[reference] = {
            "metrics": (dump / "metrics.jsonl").read_text() if info.rank == 0 else "",
            "copy_built": built[-1] is not None,
        }
    if info.rank == 0:
        out.joinpath("result.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(*map(Path, sys.argv[1:4]))
