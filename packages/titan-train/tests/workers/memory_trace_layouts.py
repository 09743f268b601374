"""torchrun worker (2 ranks): peak live bytes of a real step against the fake-tensor trace of the same step.

First, on the real gloo group, each layout x activation-checkpointing mode steps on real tensors under
the tracker. Then the group is torn down and each rank traces the same configs as itself on fake
tensors over a fake process group; rank 0 and rank 1 also split the one-process configs between them
(a world of one has no communication: its real step runs on real tensors over a fake group of one).
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from titan_train.config import load_job_config
from titan_train.distributed import init_distributed
from titan_train.plan import resolve
from titan_train.reporting.traced_memory import trace_rank, trace_step

SMALL = [
    "--model.flavor",
    "debugmodel",
    "--training.seq_len",
    "256",
    "--training.local_batch_size",
    "4",
    "--training.mixed_precision_param",
    "float32",
]
LAYOUTS = {
    "fsdp2": ["--parallelism.data_parallel_shard_degree", "2"],
    "tp2": ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2"],
    "pp2": [
        "--parallelism.data_parallel_shard_degree",
        "1",
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_microbatch_size",
        "2",
    ],
}
AC = {
    "none": ["--activation_checkpoint.mode", "none"],
    "full": ["--activation_checkpoint.mode", "full"],
    "op": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
    "every2": [
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "2",
    ],
}
N_LAYERS = 2


def summary(result) -> dict:
    return {"peak": result.peak, "label": list(result.label), "breakdown": result.breakdown}


def main() -> None:
    out = Path(sys.argv[1])
    info = init_distributed(60)
    rank = info.rank
    results: dict[str, dict] = {}
    configs = {
        f"{layout}/{ac}": load_job_config(SMALL + LAYOUTS[layout] + AC[ac]) for layout in LAYOUTS for ac in AC
    }
    for name, config in configs.items():
        results[f"real/{name}"] = summary(
            trace_step(resolve(config, 2, "cpu"), fake=False, n_layers=N_LAYERS)
        )
    dist.destroy_process_group()
    for name, config in configs.items():
        results[f"fake/{name}"] = summary(trace_rank(resolve(config, 2, "cpu"), rank, n_layers=N_LAYERS))
    for ac in list(AC)[rank::2]:
        config = load_job_config(SMALL + ["--parallelism.data_parallel_shard_degree", "1"] + AC[ac])
        for fake in (False, True):
            result = trace_rank(resolve(config, 1, "cpu"), 0, fake=fake, n_layers=N_LAYERS)
            results[f"{'fake' if fake else 'real'}/one/{ac}"] = summary(result)
    (out / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
