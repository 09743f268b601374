"""Expert load after N training steps with the auxiliary-loss-free expert bias on and off.

Trains a small Qwen3-MoE (2 layers of 8 experts, top 2, dim 64; registered here as `qwen3 bench_moe`)
through titan-train on the bundled c4_test data, once per bias step size (`load_balance_coeff`; "off"
is None: no bias), and prints per run the max/mean tokens per expert (1.00: balanced) of the first
step and averaged over the last 10 steps, worst layer and mean over layers.

    uv run python bench/moe_load_balance.py --steps 100 --coeffs off,1e-3,1e-2
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from dataclasses import replace
from pathlib import Path

from titan_models import qwen3
from titan_train.cli import run
from titan_train.registry import register_flavor


def _flavor(coeff: float | None):
    moe = replace(qwen3.qwen3_moe_args(8, 2), load_balance_coeff=coeff)
    return replace(
        qwen3.QWEN3_FLAVORS["debugmodel_moe"],
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        moe_inter_dim=64,
        moe_args=moe,
    )


def _loads(record: dict) -> list[float]:
    return [layer["max_over_mean"] for layer in record["expert_load"].values()]


def measure(coeff: float | None, steps: int, folder: Path) -> dict[str, float]:
    name = f"bench_moe_{coeff}"
    register_flavor("qwen3", name, _flavor(coeff))
    dump = folder / name
    code = run(
        [
            "--model.name",
            "qwen3",
            "--model.flavor",
            name,
            "--training.seq_len",
            "64",
            "--training.local_batch_size",
            "4",
            "--training.steps",
            str(steps),
            "--metrics.log_freq",
            "1",
            "--activation_checkpoint.mode",
            "none",
            "--compile.enable",
            "false",
            "--optimizer.lr",
            "3e-3",
            "--metrics.enable_tensorboard",
            "false",
            "--job.dump_folder",
            str(dump),
        ]
    )
    if code != 0:
        raise SystemExit(f"run with load_balance_coeff={coeff} failed ({code})")
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    last = [_loads(r) for r in records[-10:]]
    return {
        "first_worst": max(_loads(records[0])),
        "last_worst": sum(max(x) for x in last) / len(last),
        "last_mean": sum(sum(x) / len(x) for x in last) / len(last),
        "loss": records[-1]["loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--coeffs", default="off,1e-3,1e-2", help="comma-separated; 'off' = no bias")
    cli = parser.parse_args()
    logging.disable(logging.INFO)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for text in cli.coeffs.split(","):
            coeff = None if text == "off" else float(text)
            rows.append((text, measure(coeff, cli.steps, Path(tmp))))
    print(
        f"qwen3 2 layers x 8 experts top 2, {cli.steps} steps, batch 4 x seq 64; max/mean tokens per expert"
    )
    print(
        "| load_balance_coeff | step 1 worst layer | last 10 steps worst layer | last 10 mean of layers | final loss |"
    )
    print(
        "|--------------------|--------------------|---------------------------|------------------------|------------|"
    )
    for text, r in rows:
        print(
            f"| {text:>18} | {r['first_worst']:18.3f} | {r['last_worst']:25.3f} | {r['last_mean']:22.3f} "
            f"| {r['loss']:10.4f} |"
        )


if __name__ == "__main__":
    main()
