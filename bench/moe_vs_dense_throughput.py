"""Tokens/s of each MoE debug model against a dense model with the same active parameters, in one run.

For each MoE debug config (apps/configs/{deepseek_v3,qwen3_moe,llama4}_debug.toml) the script builds a
dense flavor of the same family, registered here as `<flavor>_dense`: every block a SwiGLU, all of one
width, chosen so the feed-forward parameters a token goes through are those of the MoE model. An MoE
block counts `top_k` routed plus the shared experts (Qwen3: 8 x 768 = 6144); a family that mixes dense
and MoE blocks (DeepSeek's first block, Llama 4's every other block) gets the mean width over blocks.
The table shows the total and active parameters of both, counted on a meta-device model, so the match
can be checked. Each model trains through titan-train (`titan_train.cli.run`) on the bundled c4_test
data for the same steps, batch and sequence length; the MoE and dense runs of a family follow each other
(`--repeats` rounds), and tokens/s is the median of metrics.jsonl's `tps` after `--warmup` steps.
On a shared machine wall time depends on what else runs, so each step's CPU time (all threads of this
process, taken at every optimizer step through torch's global step hook) is recorded too: tokens per
CPU-second is the figure that other jobs disturb least.

    uv run python bench/moe_vs_dense_throughput.py --steps 6 --warmup 2 --jsonl out.jsonl
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from titan_models.moe import count_active_parameters
from titan_train.cli import run
from titan_train.registry import get_model_family, register_flavor

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {"deepseek_v3": "deepseek_v3_debug", "qwen3": "qwen3_moe_debug", "llama4": "llama4_debug"}


def _moe_blocks(family: str, args: Any) -> list[bool]:
    """Which blocks are MoE (Qwen3: all of them, or none for a dense flavor)."""
    if family == "qwen3":
        return [args.moe_enabled] * args.n_layers
    return [args.is_moe_layer(i) for i in range(args.n_layers)]


def _active_ffn_width(family: str, args: Any) -> int:
    """The mean over blocks of the feed-forward width one token goes through."""
    moe = args.moe_args
    expert = {"deepseek_v3": "moe_inter_dim", "qwen3": "moe_inter_dim", "llama4": "moe_hidden_dim"}[family]
    dense = {"deepseek_v3": "inter_dim", "qwen3": "hidden_dim", "llama4": "ffn_hidden_dim"}[family]
    widths = [
        (moe.top_k + moe.num_shared_experts) * getattr(args, expert) if is_moe else getattr(args, dense)
        for is_moe in _moe_blocks(family, args)
    ]
    return round(sum(widths) / len(widths))


def dense_args(family: str, args: Any) -> Any:
    """`args` with every block a dense SwiGLU of the MoE model's active feed-forward width."""
    width = _active_ffn_width(family, args)
    if family == "qwen3":
        return replace(args, moe_args=None, hidden_dim=width)
    if family == "deepseek_v3":
        return replace(args, n_dense_layers=args.n_layers, inter_dim=width)
    # Llama 4: a step past the last block leaves no MoE block.
    return replace(args, interleave_moe_layer_step=args.n_layers + 1, dense_hidden_dim_override=width)


def parameter_counts(family: str, args: Any) -> tuple[int, int]:
    """(total, active per token) parameters of a meta-device model of `args`."""
    with torch.device("meta"):
        model = get_model_family(family).build(args)
    return sum(p.numel() for p in model.parameters()), count_active_parameters(model)


def _config_flavor(config: str) -> str:
    for line in (REPO / "apps" / "configs" / f"{config}.toml").read_text().splitlines():
        if line.startswith("flavor"):
            return line.split("=")[1].split("#")[0].strip().strip('"')
    raise SystemExit(f"{config}.toml names no flavor")


_STEP_CPU_TIMES: list[float] = []
# Every optimizer step of every run: the process's CPU time when it ends.
register_optimizer_step_post_hook(lambda *_: _STEP_CPU_TIMES.append(time.process_time()))


def train_tps(
    config: str, flavor: str, cli: argparse.Namespace, dump: Path
) -> tuple[list[float], list[float]]:
    """Per-step tokens/s and CPU seconds of the steps after warmup of one titan-train run."""
    _STEP_CPU_TIMES.clear()
    code = run(
        [
            "--job.config_file",
            str(REPO / "apps" / "configs" / f"{config}.toml"),
            "--model.flavor",
            flavor,
            "--training.local_batch_size",
            str(cli.batch),
            "--training.seq_len",
            str(cli.seq_len),
            "--training.steps",
            str(cli.steps),
            "--metrics.log_freq",
            "1",
            "--metrics.enable_tensorboard",
            "false",
            "--job.dump_folder",
            str(dump),
        ]
    )
    if code != 0:
        raise SystemExit(f"{config} with flavor {flavor} failed ({code})")
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    # Step k+1 is the CPU time between the hooks of steps k and k+1 (step 1 has no start mark).
    cpu = [b - a for a, b in zip(_STEP_CPU_TIMES, _STEP_CPU_TIMES[1:], strict=False)][
        max(cli.warmup - 1, 0) :
    ]
    return [r["tps"] for r in records if r["step"] > cli.warmup], cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the median")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--families", default=",".join(CONFIGS))
    parser.add_argument("--jsonl", type=Path, help="also write one raw record per run here")
    cli = parser.parse_args()
    logging.disable(logging.INFO)
    families = cli.families.split(",")
    rows: dict[str, dict[str, Any]] = {}
    for family in families:
        flavor = _config_flavor(CONFIGS[family])
        moe = get_model_family(family).flavors[flavor]
        dense = dense_args(family, moe)
        register_flavor(family, f"{flavor}_dense", dense)
        rows[family] = {
            "flavor": flavor,
            "dense_ffn_width": _active_ffn_width(family, moe),
            "moe_params": parameter_counts(family, moe),
            "dense_params": parameter_counts(family, dense),
            "moe_tps": [],
            "dense_tps": [],
            "moe_cpu_s": [],
            "dense_cpu_s": [],
        }
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(cli.repeats):
            for family in families:
                row = rows[family]
                for kind, flavor in (("moe", row["flavor"]), ("dense", f"{row['flavor']}_dense")):
                    tps, cpu = train_tps(
                        CONFIGS[family], flavor, cli, Path(tmp) / f"{family}-{kind}-{round_}"
                    )
                    row[f"{kind}_tps"] += tps
                    row[f"{kind}_cpu_s"] += cpu
                    total, active = row[f"{kind}_params"]
                    records.append(
                        {
                            "family": family,
                            "flavor": flavor,
                            "kind": kind,
                            "round": round_,
                            "steps": cli.steps,
                            "warmup": cli.warmup,
                            "batch": cli.batch,
                            "seq_len": cli.seq_len,
                            "tps": tps,
                            "step_cpu_s": cpu,
                            "total_params": total,
                            "active_params": active,
                        }
                    )
    if cli.jsonl:
        cli.jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    tokens = cli.batch * cli.seq_len
    print(
        f"CPU, batch {cli.batch} x seq {cli.seq_len}, {cli.steps} steps (medians of steps > {cli.warmup}), "
        f"{cli.repeats} round(s), float32 eager"
    )
    print(
        "| family (flavor) | model | total params | active params | tokens/s (wall) | tokens/CPU-s | MoE/dense wall | MoE/dense CPU |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for family, row in rows.items():
        tps = {k: statistics.median(row[f"{k}_tps"]) for k in ("moe", "dense")}
        per_cpu = {k: tokens / statistics.median(row[f"{k}_cpu_s"]) for k in ("moe", "dense")}
        for kind in ("moe", "dense"):
            total, active = row[f"{kind}_params"]
            label = "MoE" if kind == "moe" else f"dense, ffn {row['dense_ffn_width']}"
            ratios = (
                f"{tps['moe'] / tps['dense']:.2f}x | {per_cpu['moe'] / per_cpu['dense']:.2f}x"
                if kind == "moe"
                else " | "
            )
            print(
                f"| {family} ({row['flavor']}) | {label} | {total:,} | {active:,} | {tps[kind]:,.0f} "
                f"| {per_cpu[kind]:,.0f} | {ratios} |"
            )


if __name__ == "__main__":
    main()
