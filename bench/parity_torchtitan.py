"""Titan against torchtitan 0.2.2 itself, step by step: the same weights, data and settings, in fp32 on CPU.

torchtitan 0.2.2 and the workspace's torch are installed into their own environment (bench/.torchtitan-
0.2.2-env, ignored by git; never a dependency of the workspace). For each model family, both trainers
read torchtitan 0.2.2's own train config for it (a copy of its keys ships as a test fixture), with the
size, precision and data set on the command line; torchtitan writes a seed checkpoint on one rank
(`--checkpoint.create_seed_checkpoint`), both start from it (`checkpoint.initial_load_path`) and train
`--steps` steps on the repository's bundled tokenizer and c4_test documents in each of the family's
layouts. The table gives both trainers' loss, grad_norm and lr per step and the largest relative
difference. For a mixture-of-experts family both sides also log every layer's tokens per expert: a
top-k router is discontinuous (two layouts that agree to 1e-7 can send a tied token to different
experts), so agreement is judged up to the first step whose counts differ, and that step is reported.

    uv run python bench/parity_torchtitan.py                     # llama3, constant lr: the schedules agree
    uv run python bench/parity_torchtitan.py --schedule wsd      # warmup and decay: where they differ
    uv run python bench/parity_torchtitan.py --families deepseek_v3 qwen3_moe --steps 10
    uv run python bench/parity_torchtitan.py --families gpt_oss --steps 10

A family is one entry of FAMILIES: its torchtitan train config and its layouts.

torchtitan runs through bench/torchtitan_cpu_launch.py, whose shims (listed in the output) let it run
on a CPU. Data: torchtitan gives each of 2 data-parallel ranks a contiguous half of the documents; Titan
deals document i to rank i % 2. For a layout with 2 data-parallel ranks (FSDP, EP, which borrows them),
Titan reads a copy of the documents with the two halves interleaved, so each rank of both trainers reads
the same documents in the same order.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TORCHTITAN_VERSION = "0.2.2"
TORCHTITAN_ENV = REPO / "bench" / f".torchtitan-{TORCHTITAN_VERSION}-env"
LAUNCHER = REPO / "bench" / "torchtitan_cpu_launch.py"
ASSETS = REPO / "packages" / "titan-data" / "src" / "titan_data" / "assets"
TARGET = 1e-4

FIXTURES = REPO / "packages" / "titan-train" / "tests" / "fixtures"

# Layout name: (ranks, data-parallel ranks, flags both trainers take; they share torchtitan's schema).
LAYOUTS = {
    "1 process": (1, 1, []),
    "FSDP 2": (2, 2, ["--parallelism.data_parallel_shard_degree", "2"]),
    "TP 2": (
        2,
        1,
        ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2"],
    ),
    # Experts split over the 2 data-parallel ranks (torchtitan's EP borrows dp_shard, as Titan's does).
    "EP 2": (
        2,
        2,
        ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.expert_parallel_degree", "2"],
    ),
}


@dataclass(frozen=True)
class Family:
    """One model family of the comparison: torchtitan 0.2.2's own train config for it and its layouts."""

    toml: Path
    layouts: tuple[str, ...]


# Another family is one more entry: its torchtitan debug TOML and the layouts to run.
FAMILIES = {
    "llama3": Family(FIXTURES / "torchtitan_0.2_debug_model.toml", ("1 process", "FSDP 2", "TP 2")),
    "deepseek_v3": Family(
        FIXTURES / "torchtitan_0.2_deepseek_v3_debug_model.toml", ("1 process", "FSDP 2", "EP 2")
    ),
    "qwen3_moe": Family(FIXTURES / "torchtitan_0.2_qwen3_moe_debug.toml", ("1 process", "FSDP 2", "EP 2")),
    # Flex attention only in torchtitan: on CPU the launcher computes it densely (its shims say how).
    "gpt_oss": Family(FIXTURES / "torchtitan_0.2_gpt_oss_debug_model.toml", ("1 process", "FSDP 2", "EP 2")),
}
# constant: no warmup, no decay, so both schedules give the peak lr at every step.
# wsd: warmup and linear decay, where Titan's schedule and torchtitan's differ (see docs/migrating-...).
SCHEDULES = {"constant": ("0", "0"), "wsd": ("4", "0.5")}


def ensure_torchtitan_env() -> str:
    """Python of the separate environment holding torchtitan 0.2.2 and this workspace's torch."""
    python = TORCHTITAN_ENV / "bin" / "python"
    if not python.exists():
        uv = shutil.which("uv")
        if uv is None:
            raise SystemExit("uv is needed to build torchtitan's environment: pip install uv")
        subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(TORCHTITAN_ENV)], check=True)
        torch_version = _torch_version().split("+")[0]
        subprocess.run(
            [
                uv,
                "pip",
                "install",
                "-q",
                "--python",
                str(python),
                f"torchtitan=={TORCHTITAN_VERSION}",
                f"torch=={torch_version}",
            ],
            check=True,
        )
    return str(python)


def torchtitan_env_versions(python: str) -> tuple[str, str]:
    """(torchtitan, torch) versions installed in the environment of `python`."""
    versions = subprocess.run(
        [python, "-c", "import torch, torchtitan; print(torchtitan.__version__, torch.__version__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return versions[0], versions[1]


# torch and titan_train are imported where they are used: the pure helpers below are unit-tested
# (tests/test_bench_parity_helpers.py) without paying for torch's import.
def _torch_version() -> str:
    import torch

    return torch.__version__


def torchrun_command(*target: str, nproc: int, python: str = sys.executable) -> list[str]:
    """Titan's torchrun command line (titan_train.torchrun), for `nproc` ranks of this machine."""
    from titan_train.torchrun import torchrun_command as command

    return command(*target, nproc=nproc, python=python)


def interleave_contiguous_parts(lines: list[str], parts: int) -> list[str]:
    """Reorder `lines` so dealing line i to part i % parts gives part r the r-th contiguous block, as
    torchtitan's `split_dataset_by_node` does; the blocks must be equal (else the deal shifts)."""
    if len(lines) % parts:
        raise ValueError(f"{len(lines)} documents do not split into {parts} equal parts")
    size = len(lines) // parts
    return [lines[r * size + j] for j in range(size) for r in range(parts)]


def shim_summaries(launcher: Path = LAUNCHER) -> list[tuple[str, str]]:
    """(name, first sentence of its docstring) of every `shim_*` function in the launcher, in file order."""
    tree = ast.parse(launcher.read_text())
    out = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("shim_"):
            doc = " ".join((ast.get_docstring(node) or "").split())
            out.append((node.name, doc.split(": ")[0].split(". ")[0].rstrip(".")))
    return out


def relative_difference(a: float, b: float) -> float:
    """|a - b| / |a|, with a the reference (torchtitan); 0 when both are 0."""
    return abs(a - b) / abs(a) if a else float(a != b)


def read_records(path: Path) -> list[dict]:
    """One dict per line of a JSON-lines file (torchtitan's records or Titan's metrics.jsonl)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _run(command: list[str], log: Path, env: dict[str, str] | None = None) -> None:
    with open(log, "w") as out:
        proc = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise SystemExit(f"{' '.join(command[:6])} ... failed ({proc.returncode}); {log}:\n{tail}")


def _common_flags(args, family: Family, corpus: Path) -> list[str]:
    warmup, decay = SCHEDULES[args.schedule]
    return [
        "--job.config_file",
        str(family.toml),
        "--model.hf_assets_path",
        str(ASSETS / "tokenizer"),
        "--training.dataset",
        "c4_test",
        "--training.dataset_path",
        str(corpus),
        "--training.mixed_precision_param",
        "float32",
        # A recomputing checkpoint would route every token twice in torchtitan's counts (see the launcher).
        "--activation_checkpoint.mode",
        "none",
        "--training.steps",
        str(args.steps),
        "--training.local_batch_size",
        str(args.batch),
        "--training.seq_len",
        str(args.seq_len),
        "--lr_scheduler.warmup_steps",
        warmup,
        "--lr_scheduler.decay_ratio",
        decay,
        "--metrics.log_freq",
        "1",
    ]


def _torchtitan_env(work: Path, records: Path | None, float32_norm: bool) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_DATASETS_CACHE=str(work / "hf_cache"))
    env["PARITY_GPT_OSS_FLOAT32"] = "1"  # see the launcher's shim_gpt_oss_blocks_in_float32
    env.pop("PARITY_RECORDS", None)
    if records is not None:
        env["PARITY_RECORDS"] = str(records)
    if float32_norm:
        env["PARITY_FLOAT32_NORM"] = "1"
    return env


def run_layout(
    args, python: str, work: Path, seed: Path, family: Family, name: str, tag: str
) -> tuple[list[dict], list[dict]]:
    """torchtitan's and Titan's records of `args.steps` steps of layout `name`, both from `seed`."""
    nproc, dp, layout = LAYOUTS[name]
    tag = f"{tag}-{name.replace(' ', '_').lower()}"
    records = work / f"{tag}-torchtitan.jsonl"
    torchtitan = [
        *torchrun_command(str(LAUNCHER), nproc=nproc, python=python),
        *_common_flags(args, family, work / "corpus"),
        *layout,
        "--job.dump_folder",
        str(work / tag),
        "--checkpoint.enable",
        "--checkpoint.initial_load_path",
        str(seed),
        "--checkpoint.folder",
        str(work / tag / "checkpoint"),
        "--checkpoint.interval",
        "100000",
    ]
    _run(torchtitan, work / f"{tag}-torchtitan.log", _torchtitan_env(work, records, args.float32_norm))
    # Titan deals documents round robin over its data-parallel ranks; see the module docstring.
    corpus = work / ("corpus_interleaved" if dp == 2 else "corpus")
    titan_dump = work / f"{tag}-titan"
    titan = [
        *torchrun_command("-m", "titan_train.cli", nproc=nproc),
        *_common_flags(args, family, corpus),
        *layout,
        "--job.dump_folder",
        str(titan_dump),
        "--checkpoint.enable",
        "true",
        "--checkpoint.load_only",
        "true",
        "--checkpoint.initial_load_path",
        str(seed),
    ]
    _run(titan, work / f"{tag}-titan.log", dict(os.environ, OMP_NUM_THREADS="1"))
    return read_records(records), read_records(titan_dump / "metrics.jsonl")


def write_corpora(work: Path) -> None:
    """The c4_test documents as torchtitan reads them (`datasets` takes a file named *test* for the
    test split, so the copy is renamed), and interleaved by halves for Titan's data-parallel runs."""
    lines = (ASSETS / "c4_test" / "c4_test.jsonl").read_text().splitlines(keepends=True)
    for folder, ordered in (("corpus", lines), ("corpus_interleaved", interleave_contiguous_parts(lines, 2))):
        (work / folder).mkdir()
        (work / folder / "documents.jsonl").write_text("".join(ordered))


def expert_counts(record: dict) -> list[list[float]] | None:
    """A record's tokens per expert, one list per MoE layer in layer order, from either trainer's record
    (torchtitan's launcher writes a list of layers, Titan's metrics.jsonl a dict by layer name)."""
    counts = record.get("expert_counts")
    if isinstance(counts, dict):
        counts = list(counts.values())
    return None if counts is None else [[float(c) for c in layer] for layer in counts]


def first_routing_difference(theirs: list[dict], ours: list[dict]) -> int | None:
    """The first step whose per-expert counts differ between the two trainers (None: they never do, or
    the family has no experts)."""
    for a, b in zip(theirs, ours, strict=False):
        if expert_counts(a) != expert_counts(b):
            return a["step"]
    return None


@dataclass(frozen=True)
class LayoutSummary:
    """One layout's largest relative differences over the steps before the first routing difference
    (all steps when routing never differs), and that step."""

    loss: float
    grad_norm: float
    lr: float
    routing_differs_at: int | None
    steps_compared: int
    has_experts: bool


def print_layout(name: str, theirs: list[dict], ours: list[dict]) -> LayoutSummary:
    """Print one layout's steps; return its summary."""
    moe = expert_counts(theirs[0]) is not None if theirs else False
    differs_at = first_routing_difference(theirs, ours)
    print(f"\n### {name}\n")
    print(
        "| step | loss torchtitan | loss Titan | rel | grad_norm torchtitan | grad_norm Titan | rel "
        f"| lr torchtitan | lr Titan |{' expert counts |' if moe else ''}"
    )
    print(f"|---:|---:|---:|---:|---:|---:|---:|---:|---:|{'---|' if moe else ''}")
    worst = [0.0, 0.0, 0.0]
    compared = 0
    for a, b in zip(theirs, ours, strict=False):
        rel = [relative_difference(a[k], b[k]) for k in ("loss", "grad_norm", "lr")]
        if differs_at is None or a["step"] < differs_at:
            worst = [max(w, r) for w, r in zip(worst, rel, strict=True)]
            compared += 1
        counts = ""
        if moe:
            a_counts, b_counts = expert_counts(a), expert_counts(b)
            moved = sum(
                abs(x - y)
                for la, lb in zip(a_counts, b_counts, strict=True)
                for x, y in zip(la, lb, strict=True)
            )
            counts = " equal |" if moved == 0 else f" differ ({moved / 2:g} token-choices moved) |"
        print(
            f"| {a['step']} | {a['loss']:.6f} | {b['loss']:.6f} | {rel[0]:.1e} | {a['grad_norm']:.6f} "
            f"| {b['grad_norm']:.6f} | {rel[1]:.1e} | {a['lr']:.3e} | {b['lr']:.3e} |{counts}"
        )
    if len(theirs) != len(ours):
        print(f"(torchtitan logged {len(theirs)} steps, Titan {len(ours)})")
    return LayoutSummary(worst[0], worst[1], worst[2], differs_at, compared, moe)


def _record(args, family: str, layout: str, a: dict, b: dict) -> str:
    keep = ("step", "loss", "grad_norm", "lr")
    ours = {k: b[k] for k in keep}
    theirs = {k: a[k] for k in keep}
    if expert_counts(a) is not None:
        theirs["expert_counts"] = expert_counts(a)
        ours["expert_counts"] = expert_counts(b)
    return json.dumps(
        dict(
            date=datetime.date.today().isoformat(),
            family=family,
            layout=layout,
            schedule=args.schedule,
            float32_norm=args.float32_norm,
            step=a["step"],
            torchtitan=theirs,
            titan=ours,
        )
    )


def run_family(args, python: str, work: Path, name: str) -> list[tuple[str, LayoutSummary]]:
    """Seed checkpoint, then every asked layout of family `name`; the summary row of each."""
    family = FAMILIES[name]
    seed_flags = [
        *torchrun_command(str(LAUNCHER), nproc=1, python=python),
        *_common_flags(args, family, work / "corpus"),
        "--job.dump_folder",
        str(work / f"{name}-seed"),
        "--checkpoint.enable",
        "--checkpoint.create_seed_checkpoint",
        "--checkpoint.folder",
        str(work / f"{name}-seed"),
    ]
    _run(seed_flags, work / f"{name}-seed.log", _torchtitan_env(work, None, args.float32_norm))
    seed = work / f"{name}-seed" / "step-0"
    print(f"\n## {name} ({family.toml.name})")
    summary = []
    for layout in family.layouts:
        if args.layouts and layout not in args.layouts:
            continue
        theirs, ours = run_layout(args, python, work, seed, family, layout, name)
        summary.append((layout, print_layout(f"{name}, {layout}", theirs, ours)))
        if args.records:
            with open(args.records, "a") as out:
                for a, b in zip(theirs, ours, strict=False):
                    out.write(_record(args, name, layout, a, b) + "\n")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", choices=list(FAMILIES), default=["llama3"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="constant")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), help="default: each family's own")
    parser.add_argument(
        "--float32-norm",
        action="store_true",
        help="leave out shim_grad_norm_float64: torchtitan's own float32 CPU grad norm",
    )
    parser.add_argument("--records", type=Path, help="append every step of both trainers here (JSON lines)")
    args = parser.parse_args()

    python = ensure_torchtitan_env()
    version = torchtitan_env_versions(python)
    work = Path(tempfile.mkdtemp(prefix="parity-"))
    write_corpora(work)
    print(
        f"torchtitan {version[0]} (torch {version[1]}) against Titan (torch {_torch_version()}), "
        f"{', '.join(args.families)}: torchtitan's own train configs, fp32, CPU, {args.steps} steps of "
        f"{args.batch} x {args.seq_len} tokens per rank, schedule {args.schedule} (warmup_steps "
        f"{SCHEDULES[args.schedule][0]}, decay_ratio {SCHEDULES[args.schedule][1]}); both from torchtitan's "
        "seed checkpoint"
    )
    print("\ntorchtitan's CPU shims (bench/torchtitan_cpu_launch.py):")
    for shim, summary in shim_summaries():
        skipped = args.float32_norm and shim == "shim_grad_norm_float64"
        print(f"- {shim}{' (left out: --float32-norm)' if skipped else ''}: {summary}")
    rows = [
        (family, layout, s)
        for family in args.families
        for layout, s in run_family(args, python, work, family)
    ]
    print(
        f"\n### Largest relative difference over the steps before the first routing difference "
        f"(all {args.steps} steps when there is none; target {TARGET:g})\n"
    )
    print(
        "| family | layout | steps compared | loss | grad_norm | lr | within target | first step routed differently |"
    )
    print("|---|---|---:|---:|---:|---:|---|---|")
    for family, layout, s in rows:
        ok = "yes" if max(s.loss, s.grad_norm) <= TARGET else "no"
        differs = "none" if s.routing_differs_at is None else str(s.routing_differs_at)
        if not s.has_experts:
            differs = "(no experts)"
        print(
            f"| {family} | {layout} | {s.steps_compared} | {s.loss:.1e} | {s.grad_norm:.1e} | {s.lr:.1e} "
            f"| {ok} | {differs} |"
        )
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
