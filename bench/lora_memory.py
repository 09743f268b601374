"""Peak memory of a LoRA training step against a full fine-tuning step, in the same run.

CPU, measured: each mode trains the llama3 debug model a few steps in a fresh process
(`titan-train`, one rank), and the table shows that process's peak resident memory (`ru_maxrss`)
and the trainable parameters and optimizer-state tensors the trainer held. GPU, traced: the dry run's
memory trace of one step of Llama 3.1 8B on one H100 (fake tensors, nothing computed), LoRA against
full fine-tuning.

    uv run python bench/lora_memory.py [--steps 3] [--skip-dry-run]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = {
    "full fine-tuning": (),
    "LoRA (all-linear, rank 8)": ("--model.converters", "lora", "--lora.target_modules", "all-linear"),
}
CPU_FLAGS = (
    "--training.seq_len", "256", "--training.local_batch_size", "4", "--activation_checkpoint.mode", "none",
    "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "1", "--optimizer.implementation", "foreach",
)  # fmt: skip

_CHILD = """
import json, resource, sys
import torch
from titan_train.config import load_job_config
from titan_train.distributed import DistInfo
from titan_train.plan import resolve
from titan_train.trainer import Trainer
import torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
config = load_job_config(sys.argv[3:])
trainer = Trainer(resolve(config, 1, "cpu"), DistInfo(0, 0, 1, torch.device("cpu")))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
trainer.train()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
params = [p for part in trainer.model_parts for p in part.parameters()]
state = [t for o in trainer.optimizers.optimizers for s in o.state.values() for t in s.values()
         if torch.is_tensor(t) and t.dim() > 0]
out = {"built_rss": before, "peak_rss": peak,
       "params": sum(p.numel() for p in params), "trainable": sum(p.numel() for p in params if p.requires_grad),
       "optimizer_bytes": sum(t.numel() * t.element_size() for t in state)}
open(sys.argv[2], "w").write(json.dumps(out))
"""


def cpu_row(name: str, flags: tuple[str, ...], steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        argv = ["--job.dump_folder", tmp, *CPU_FLAGS, "--training.steps", str(steps), *flags]
        subprocess.run([sys.executable, "-c", _CHILD, f"{tmp}/store", str(out), *argv], check=True, cwd=REPO)
        return {"mode": name, **json.loads(out.read_text())}


def dry_run(flags: tuple[str, ...]) -> dict:
    command = [sys.executable, "-m", "titan_train.cli", "dry-run", "--ngpu", "1", "--job.config_file",
               str(REPO / "apps/configs/llama3_8b.toml"), "--training.local_batch_size", "1",
               "--training.seq_len", "2048", *flags]  # fmt: skip
    text = subprocess.run(command, capture_output=True, text=True, cwd=REPO).stdout
    text += subprocess.run(command, capture_output=True, text=True, cwd=REPO).stderr if not text else ""
    found = {}
    for key in ("parameters", "optimizer state", "activations", "peak allocated"):
        m = re.search(rf"\s{key} +([\d.]+) GiB", text)
        found[key] = float(m.group(1)) if m else None
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--skip-dry-run", action="store_true")
    args = parser.parse_args()
    mib = 2**20
    print("| CPU, llama3 debugmodel, batch 4 x seq 256, fp32 | parameters | trainable | optimizer state | "
          "RSS once built | peak RSS over the steps |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name, flags in MODES.items():
        r = cpu_row(name, flags, args.steps)
        print(f"| {name} | {r['params']:,} | {r['trainable']:,} | {r['optimizer_bytes'] / mib:.2f} MiB | "
              f"{r['built_rss'] / mib:.0f} MiB | {r['peak_rss'] / mib:.0f} MiB |")  # fmt: skip
    if args.skip_dry_run:
        return
    print()
    print("| dry run, Llama 3.1 8B, one H100, batch 1 x seq 2048 | parameters | optimizer state | activations | "
          "peak allocated |")  # fmt: skip
    print("|---|---|---|---|---|")
    for name, flags in MODES.items():
        r = dry_run(flags)
        print(f"| {name} | {r['parameters']} GiB | {r['optimizer state']} GiB | {r['activations']} GiB | "
              f"{r['peak allocated']} GiB |")  # fmt: skip


if __name__ == "__main__":
    main()
