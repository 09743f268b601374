"""Fine-tuning and RL recipes on one GPU, each run beside the run it is judged against, in one command.

Every run is `titan-train` under torchrun on one GPU (bench/peak_memory_run.py writes the CUDA allocator's
peaks at exit), bf16 mixed precision, eager; each figure is the median, over the steps after the first, of
what the run wrote to metrics.jsonl. The cases, most important first (issue 62's items 3 and 4):
- sft: packed against padded rows, trained tokens/s (labels not -100), on conversations of mixed lengths
  (one to three exchanges, each turn's length lognormal) cut from the bundled c4_test text; target >= 1.5x;
- lora: Llama 3.1 8B's blocks cut to 4 (bench/cut_flavors.py), LoRA all-linear rank 16 with the base
  in bf16 and in NF4, beside full fine-tuning: each run's peak allocated against the dry run's estimate of
  the same flags (`titan-train dry-run --ngpu 1`); target within 5%;
- dpo: packed against padded pairs, trained (completion) tokens/s, a frozen reference copy;
- muon: Muon's step time against AdamW's (one GPU: nothing is gathered; Muon's log line gives the
  Newton-Schulz share of its optimizer steps);
- grpo: the titan engine's rollout tokens/s and generation's share of the step (random weights seldom
  sample an end token, so nearly every completion runs to max_completion_length; the record keeps the
  mean length);
- mtp: DeepSeek-V2-Lite's blocks cut to 4 with one multi-token-prediction depth against none: step time.
Each case's second column of ratios is the run against the case's first run.

On the GPU machine (after apps/gpu/fetch_wheels.sh here; carry .whl):
    apps/gpu/recipes.sh
Here, without a GPU: `--estimate-only` dry-runs every GPU run's flags (refusals show before a lease is
spent); `--small` runs every case at the debug shapes on this CPU, to see each one start and be read.
    uv run python bench/gpu_recipes.py --estimate-only
    uv run python bench/gpu_recipes.py --small --cases sft,grpo
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from memory_vs_gpu import _gib, _last_line, _ratio, dry_run_estimate, run_env  # bench/ is the script's folder
from peak_memory_run import launch

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
ASSETS = REPO / "packages/titan-data/src/titan_data/assets"
GIB = 2**30
MUON_LINE = re.compile(r"muon: to step \d+: optimizer steps ([\d.]+) s, Newton-Schulz (\d+)%")


@dataclass(frozen=True)
class Shape:
    """The model shapes and lengths of one scale: the GPU's, or --small's for this CPU."""

    dense: str  # llama3 flavor of sft, dpo, muon, grpo
    cut: str  # llama3 flavor of lora and qlora
    moe: str  # deepseek_v3 flavor of mtp
    seq_len: int
    batch: int
    turn_words: int  # median words of a turn in the mixed-length conversations
    completions: int  # grpo: generated tokens per completion
    prompts: int  # grpo: prompts per step (8 completions each)


GPU = Shape("1B", "8B_4layers", "16B_4layers", 4096, 4, 160, 256, 8)
SMALL = Shape("debugmodel", "debugmodel", "debugmodel", 256, 2, 8, 16, 2)


@dataclass(frozen=True)
class Run:
    name: str
    flags: tuple[str, ...]
    estimate: bool = False  # also the dry run's memory estimate of the same flags


@dataclass
class Row:
    case: str
    run: str
    steps: int = 0
    tps: float | None = None
    trained_tps: float | None = None
    step_s: float | None = None
    allocated: int | None = None
    reserved: int | None = None
    estimated_allocated: int | None = None
    rollout_tps: float | None = None
    generation_share: float | None = None
    newton_schulz_share: float | None = None
    seconds: float = 0.0
    error: str | None = None
    extra: dict = field(default_factory=dict)


def _base(config: str, shape: Shape, steps: int, dump: str | None = None) -> list[str]:
    flags = [
        "--job.config_file", str(REPO / "apps/configs" / config),
        "--experimental.custom_import", "cut_flavors",
        "--training.seq_len", str(shape.seq_len),
        "--training.local_batch_size", str(shape.batch),
        "--training.steps", str(steps),
        "--training.mixed_precision_param", "bfloat16",
        "--metrics.log_freq", "1",
        "--metrics.enable_tensorboard", "false",
        "--metrics.disable_color_printing",
        "--lr_scheduler.warmup_steps", "1",
        "--checkpoint.enable", "false",
        "--activation_checkpoint.mode", "selective",
        "--activation_checkpoint.selective_ac_option", "op",
    ]  # fmt: skip
    return flags + (["--job.dump_folder", dump] if dump else [])


def cases(shape: Shape, data: Path, steps: int) -> dict[str, list[Run]]:
    """Each case's runs, its reference first; flags without the dump folder (each run gets its own)."""

    def on(config: str, *flags: str) -> tuple[str, ...]:
        return (*_base(config, shape, steps), *flags)

    sft = ("--model.flavor", shape.dense, "--training.dataset_path", str(data / "chat.jsonl"))
    dpo = ("--model.flavor", shape.dense, "--training.dataset_path", str(data / "preference.jsonl"))
    lora = ("--model.converters", "lora", "--lora.target_modules", "all-linear", "--lora.rank", "16")
    dense = ("--model.flavor", shape.dense)
    grpo = (
        "--model.flavor", shape.dense,
        "--training.local_batch_size", str(8 * shape.prompts),
        "--training.seq_len", str(64 + shape.completions),
        "--grpo.max_prompt_length", "64",
        "--grpo.max_completion_length", str(shape.completions),
    )  # fmt: skip
    moe = ("--model.name", "deepseek_v3", "--model.flavor", shape.moe)
    return {
        "sft": [
            Run("padded", on("debug_sft.toml", *sft, "--sft.packing", "false")),
            Run("packed", on("debug_sft.toml", *sft, "--sft.packing", "true")),
        ],
        "lora": [
            Run("full fine-tuning", on("debug_model.toml", "--model.flavor", shape.cut), estimate=True),
            Run(
                "LoRA (bf16 base)", on("debug_model.toml", "--model.flavor", shape.cut, *lora), estimate=True
            ),
            Run(
                "QLoRA (NF4 base)",
                on("debug_model.toml", "--model.flavor", shape.cut, *lora, "--lora.quantize_base", "nf4"),
                estimate=True,
            ),
        ],
        "dpo": [
            Run("padded", on("debug_dpo.toml", *dpo, "--sft.packing", "false")),
            Run("packed", on("debug_dpo.toml", *dpo, "--sft.packing", "true")),
        ],
        "muon": [
            Run("AdamW", on("debug_model.toml", *dense)),
            Run("Muon", on("debug_model.toml", *dense, "--optimizer.name", "Muon")),
        ],
        "grpo": [Run("titan engine", on("debug_grpo.toml", *grpo))],
        "mtp": [
            Run("no MTP", on("debug_model.toml", *moe)),
            Run("MTP depth 1", on("debug_model.toml", *moe, "--model.num_mtp_layers", "1")),
        ],
    }


def write_data(folder: Path, shape: Shape, rows: int, seed: int = 0) -> None:
    """Conversations and preference pairs of mixed lengths, cut in order from the bundled c4_test text."""
    words = [w for line in open(ASSETS / "c4_test/c4_test.jsonl") for w in json.loads(line)["text"].split()]
    rng = random.Random(seed)
    at = 0

    def turn() -> str:
        nonlocal at
        n = max(3, min(int(rng.lognormvariate(math.log(shape.turn_words), 1.0)), 8 * shape.turn_words))
        if at + n > len(words):
            at = 0
        at += n
        return " ".join(words[at - n : at])

    with open(folder / "chat.jsonl", "w") as chat, open(folder / "preference.jsonl", "w") as pairs:
        for _ in range(rows):
            messages = []
            for _ in range(rng.randint(1, 3)):
                messages += [{"role": "user", "content": turn()}, {"role": "assistant", "content": turn()}]
            chat.write(json.dumps({"messages": messages}) + "\n")
            prompt = [{"role": "user", "content": turn()}]
            chosen, rejected = [{"role": "assistant", "content": turn()} for _ in range(2)]
            pairs.write(json.dumps({"prompt": prompt, "chosen": [chosen], "rejected": [rejected]}) + "\n")


def estimate(run: Run, row: Row) -> None:
    """The dry run's traced peak allocated for one GPU, or the refusal it printed."""
    match = dry_run_estimate(list(run.flags), run_env())
    if isinstance(match, str):
        row.error = match
    else:
        row.estimated_allocated = round(float(match.group(1)) * GIB)


def measure(run: Run, row: Row, keep: Path | None) -> None:
    """One real run on one rank; the medians of its records after the first step."""
    name = f"{row.case}_{re.sub(r'[^a-z0-9]+', '_', row.run.lower())}.log"
    launched = launch(list(run.flags), run_env(), keep / name if keep else None)
    text, records = launched.text, launched.records
    if launched.returncode != 0:
        row.error = "OOM" if "out of memory" in text.lower() else _last_line(text)
    if launched.peaks:
        row.allocated, row.reserved = launched.peaks["allocated"], launched.peaks["reserved"]
    later = [r for r in records if r["step"] > 1]
    row.steps = len(later)
    if not later:
        row.error = row.error or "no step after the first was recorded"
        return

    def median(key) -> float:
        return statistics.median(key(r) for r in later)

    row.tps, row.trained_tps = median(lambda r: r["tps"]), median(lambda r: r["trained_tps"])
    row.step_s = median(lambda r: r["step_time_s"])
    if all("rollout_tps" in r for r in later):  # the objective's metrics sit beside the step's in a record
        row.rollout_tps = median(lambda r: r["rollout_tps"])
        row.generation_share = median(lambda r: r["time/generation_s"] / r["step_time_s"])
        row.extra["completion_mean_length"] = median(lambda r: r["completions/mean_length"])
    muon = [(float(s), int(ns)) for s, ns in MUON_LINE.findall(text)][1:]  # the first is the warm-up step
    if muon:
        row.newton_schulz_share = statistics.median(ns for _, ns in muon) / 100
        row.extra["muon_optimizer_s"] = statistics.median(s for s, _ in muon)


def _fmt(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def print_table(rows: list[Row], header: str) -> None:
    print(f"\n{header}\n")
    print(
        "| case | run | tokens/s | trained tokens/s | x first (trained) | step s | x first (step) "
        "| peak allocated GiB | estimated GiB | estimate / measured | reserved GiB | rollout tokens/s "
        "| generation share | Newton-Schulz share | note |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    first: dict[str, Row] = {}
    for r in rows:
        f = first.setdefault(r.case, r)
        print(
            f"| {r.case} | {r.run} | {_fmt(r.tps, ',.0f')} | {_fmt(r.trained_tps, ',.0f')} "
            f"| {_ratio(r.trained_tps, f.trained_tps)} | {_fmt(r.step_s, '.3f')} | {_ratio(r.step_s, f.step_s)} "
            f"| {_gib(r.allocated)} | {_gib(r.estimated_allocated)} "
            f"| {_ratio(r.estimated_allocated, r.allocated)} | {_gib(r.reserved)} "
            f"| {_fmt(r.rollout_tps, ',.0f')} | {_fmt(r.generation_share, '.0%')} "
            f"| {_fmt(r.newton_schulz_share, '.0%')} | {r.error or ''} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="sft,lora,dpo,muon,grpo,mtp")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rows", type=int, default=2000, help="conversations (and pairs) written")
    parser.add_argument("--small", action="store_true", help="the debug shapes, on this machine's device")
    parser.add_argument("--estimate-only", action="store_true", help="no GPU: dry-run every run's flags")
    parser.add_argument("--keep", type=Path, help="folder to keep each run's log in")
    parser.add_argument("--out", type=Path, help="JSON lines: one record per run, appended as it ends")
    parser.add_argument("--table-from", type=Path, help="print the table of an earlier --out file and stop")
    args = parser.parse_args()
    if args.table_from:
        records = [json.loads(line) for line in args.table_from.read_text().splitlines()]
        header = records[0].pop("device")
        print_table([Row(**{k: v for k, v in r.items() if k != "device"}) for r in records], header)
        return
    import torch

    shape = SMALL if args.small else GPU
    if not (args.small or args.estimate_only or torch.cuda.is_available()):
        raise SystemExit("the GPU shapes need a CUDA GPU: pass --estimate-only or --small here")
    device = (
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
        if torch.cuda.is_available()
        else f"CPU, torch {torch.__version__}"
    )
    header = (
        f"{'--small' if args.small else 'GPU shapes'}: seq {shape.seq_len}, batch {shape.batch}, {args.steps} "
        f"steps, one rank, bf16, eager; {device}"
    )
    print(header, flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as data:
        write_data(Path(data), shape, args.rows)
        every = cases(shape, Path(data), args.steps)
        for case in args.cases.split(","):
            if case not in every:
                raise SystemExit(f"unknown case {case!r}: choose from {','.join(every)}")
            for run in every[case]:
                row = Row(case, run.name)
                started = time.perf_counter()
                if run.estimate or args.estimate_only:
                    estimate(run, row)
                if not args.estimate_only and row.error is None:
                    measure(run, row, args.keep)
                row.seconds = time.perf_counter() - started
                rows.append(row)
                print(f"{case} / {run.name}: {row.seconds:.0f} s {row.error or ''}", flush=True)
                if args.out:
                    with open(args.out, "a") as out:
                        out.write(json.dumps({"device": header, **asdict(row)}) + "\n")
    print_table(rows, header)


if __name__ == "__main__":
    main()
