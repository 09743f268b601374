"""Whole-run peak host memory (RSS) of each rank when a run starts from a Hugging Face folder and exports to one.

`uv run python bench/hf_start_memory.py --out DIR [--repeats 3] [--layers 16] [--dim 1024]`: transformers writes a
Llama (hidden `--dim`, `--layers` blocks, fp32) in 120 MB shards with the bundled tokenizer. Three 4-rank FSDP
runs of `titan-train` (seq 128, batch 1) are then sampled from outside, each rank's /proc/PID/statm every 50 ms:

- `hf import + step + hf export`: `model.flavor from_hf`, `initial_load_in_hf`, one step, `last_save_in_hf` (the issue's run);
- `hf import only`: the same with `training.steps 0` and no export: the import's pre-step peak;
- `dcp resume only`: `training.steps 0` resumed from the DCP checkpoint the first run saved (the same
  weights, no Hugging Face read): the baseline the import's pre-step peak is held against.

Each row gives every rank's peak and the spread, (highest rank - median rank) / model's fp32 bytes: issue 63
bounds the export run's at 0.5. `tests/test_hf_start_memory.py` checks the same bound on a smaller model.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUNDLED_TOKENIZER = REPO / "packages" / "titan-data" / "src" / "titan_data" / "assets" / "tokenizer"
PAGE = 4096


def write_llama(folder: Path, dim: int, layers: int) -> int:
    """A transformers Llama saved in 120 MB shards beside the bundled tokenizer; returns its fp32 bytes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=dim,
        intermediate_size=4 * dim,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=2048,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        bos_token_id=1792,
        eos_token_id=1793,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, max_shard_size="120MB")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(BUNDLED_TOKENIZER / name, folder / name)
    return sum(p.numel() * 4 for p in model.parameters())


# A process that ran a Trainer without torchrun keeps RANK/LOCAL_RANK=0 in its environment
# (titan_train.distributed), and a worker forked by torchrun but not yet exec'd shows torchrun's environment:
# launched with them, that worker would read as rank 0 for good and its rank would go unsampled.
_LAUNCH_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def _launcher_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}


def _rank_of(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in environ:
        if item.startswith(b"LOCAL_RANK="):
            return int(item.split(b"=", 1)[1])
    return None


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid`, from every /proc/N/stat (the per-thread `children` files are not
    guaranteed complete while the process runs)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses, so split after its last ')'.
        if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def peak_rss_per_rank(cmd: list[str], log: Path, every: float = 0.05) -> list[int]:
    """Run `cmd` (a torchrun) and return each rank's peak RSS in bytes, sampled every `every` seconds."""
    peaks: dict[int, int] = {}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_launcher_env())
    stop = threading.Event()

    def sample():
        ranks: dict[int, int] = {}
        while not stop.is_set():
            for child in _children(proc.pid):
                if child not in ranks and (rank := _rank_of(child)) is not None:
                    ranks[child] = rank
            for pid, rank in ranks.items():
                try:
                    rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
                except OSError:
                    continue
                peaks[rank] = max(peaks.get(rank, 0), rss)
            stop.wait(every)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    rc = proc.wait(timeout=3600)
    stop.set()
    thread.join()
    if rc != 0:
        sys.exit(f"{' '.join(cmd)} failed ({rc}):\n{log.read_text()[-4000:]}")
    return [peaks[r] for r in sorted(peaks)]


def spread(peaks: list[int], model_bytes: int) -> float:
    return (max(peaks) - statistics.median(peaks)) / model_bytes


def torchrun(ranks: int, argv: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(ranks),
        "-m",
        "titan_train.cli",
        *argv,
    ]


def common(folder: Path, dump: Path) -> list[str]:
    return [
        *("--job.config_file", str(REPO / "apps" / "configs" / "debug_model.toml")),
        *("--job.dump_folder", str(dump), "--model.name", "llama3", "--model.flavor", "from_hf"),
        *("--model.hf_assets_path", str(folder), "--training.seq_len", "128", "--training.local_batch_size", "1"),
        *("--metrics.disable_color_printing", "--metrics.enable_tensorboard", "false", "--metrics.log_freq", "1"),
        *("--checkpoint.enable", "--checkpoint.keep_latest_k", "0"),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=1, help="steps of the export run")
    parser.add_argument(
        "--runs",
        default="hf import + step + hf export,hf import only,dcp resume only",
        help="a subset, comma-separated",
    )
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    folder = args.out / "hf"
    model_bytes = write_llama(folder, args.dim, args.layers)
    rows = []
    for repeat in range(args.repeats):
        dump = args.out / f"run{repeat}"
        hf_flags = ["--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", str(folder)]
        runs = {
            "hf import + step + hf export": [
                *common(folder, dump / "export"),
                *hf_flags,
                *("--training.steps", str(args.steps), "--checkpoint.last_save_in_hf"),
            ],
            "hf import only": [*common(folder, dump / "import"), *hf_flags, "--training.steps", "0"],
            "dcp resume only": [
                *common(folder, dump / "resume"),
                *(
                    "--checkpoint.initial_load_path",
                    str(dump / "export" / "checkpoint" / f"step-{args.steps}"),
                ),
                "--training.steps",
                "0",
            ],
        }
        for what, argv in runs.items():
            if what not in args.runs.split(","):
                continue
            started = time.perf_counter()
            peaks = peak_rss_per_rank(
                torchrun(args.ranks, argv), args.out / f"{what.replace(' ', '_')}-{repeat}.log"
            )
            rows.append(
                f"| {repeat + 1} | {what} | {' / '.join(f'{p / 2**20:.0f}' for p in peaks)} "
                f"| {max(peaks) / 2**20:.0f} | {spread(peaks, model_bytes):.2f} |"
            )
            print(rows[-1], f"({time.perf_counter() - started:.0f} s)", flush=True)
        shutil.rmtree(dump, ignore_errors=True)  # GBs of checkpoints a repeat; the logs stay in --out
    print(f"\nmodel: {model_bytes / 2**20:.0f} MiB fp32, {args.ranks} ranks FSDP\n")
    print(
        "| run | what | peak RSS per rank MiB | highest MiB | (max - median) / model |\n|---|---|---|---|---|"
    )
    print("\n".join(rows))


if __name__ == "__main__":
    main()
