"""Parameter counts and training FLOPs per token: Titan's plan against torchtitan 0.2.2's own function.

Titan's numbers are what a run logs and MFU divides by: `titan_train.plan.resolve` on a config naming the
flavor (`plan.params.total`, `plan.flops_per_token`). torchtitan's are its model args'
`get_nparams_and_flops(model, seq_len)` on its own model of the same flavor, built on the meta device
in torchtitan 0.2.2's environment (bench/.torchtitan-0.2.2-env, made as bench/parity_torchtitan.py makes
it; never a workspace dependency), in a child process. Prints one table; `--json` writes the rows, which
packages/titan-train/tests/test_flops_against_torchtitan.py pins.

    uv run python bench/flops_against_torchtitan.py [--json rows.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from parity_torchtitan import ensure_torchtitan_env, torchtitan_env_versions  # noqa: E402

# (Titan model name, flavor, seq_len). torchtitan 0.2.2 names every one of these flavors alike. The
# sequence lengths are the shipped configs' (apps/configs), the debug flavors' 2048, and gpt-oss at
# 128 too, the window of its sliding layers.
ROWS = [
    ("llama3", "debugmodel", 2048),
    ("llama3", "8B", 8192),
    ("deepseek_v3", "debugmodel", 2048),
    ("deepseek_v3", "16B", 4096),
    ("deepseek_v3", "671B", 4096),
    ("qwen3", "debugmodel_moe", 2048),
    ("qwen3", "30B-A3B", 4096),
    ("llama4", "debugmodel", 2048),
    ("llama4", "17bx16e", 8192),
    ("llama4", "17bx16e_irope", 8192),
    ("gpt_oss", "debugmodel", 2048),
    ("gpt_oss", "20b", 128),
    ("gpt_oss", "20b", 8192),
    ("gpt_oss", "120b", 8192),
]

# Run by torchtitan's environment, as its trainer does (train.py): the flavor's args updated from a job
# config of the same model and seq_len, its model class on the meta device, its own counting function.
_TORCHTITAN_COUNTS = """
import copy, json, sys, torch
import torchtitan.models  # registers the train specs
from torchtitan.config import ConfigManager
from torchtitan.protocols.train_spec import get_train_spec
rows = []
for name, flavor, seq_len in json.loads(sys.argv[1]):
    spec = get_train_spec(name)
    args = copy.deepcopy(spec.model_args[flavor])
    job = ConfigManager().parse_args(
        ["--model.name", name, "--model.flavor", flavor, "--training.seq_len", str(seq_len)]
    )
    args.update_from_config(job)
    with torch.device("meta"):
        model = spec.model_cls(args)
    nparams, flops = args.get_nparams_and_flops(model, seq_len)
    rows.append([nparams, flops])
print(json.dumps(rows))
"""


def torchtitan_counts(python: str, rows: list) -> list[tuple[int, float]]:
    """torchtitan 0.2.2's (nparams, FLOPs per token) for each row, from its environment's `python`."""
    done = subprocess.run(
        [python, "-c", _TORCHTITAN_COUNTS, json.dumps(rows)], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"torchtitan's counts failed:\n{done.stderr[-3000:]}")
    return [tuple(r) for r in json.loads(done.stdout.strip().splitlines()[-1])]


def titan_counts(name: str, flavor: str, seq_len: int) -> tuple[int, float]:
    """Titan's (parameters, FLOPs per token) as a run of this flavor at `seq_len` on one GPU plans them."""
    from titan_train.config import load_job_config
    from titan_train.plan import resolve

    config = load_job_config(
        ["--model.name", name, "--model.flavor", flavor, "--training.seq_len", str(seq_len)]
    )
    plan = resolve(config, 1, "cuda")
    return plan.params.total, plan.flops_per_token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the rows here as JSON")
    args = parser.parse_args()
    python = ensure_torchtitan_env()
    torchtitan_version, torch_version = torchtitan_env_versions(python)
    theirs = torchtitan_counts(python, ROWS)
    records = []
    print(f"torchtitan {torchtitan_version} (torch {torch_version}) against Titan\n")
    print(
        "| model | flavor | seq_len | params Titan | params torchtitan | FLOPs/token Titan | FLOPs/token torchtitan | FLOPs ratio |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for (name, flavor, seq_len), (tt_params, tt_flops) in zip(ROWS, theirs, strict=True):
        params, flops = titan_counts(name, flavor, seq_len)
        records.append(
            dict(
                model=name,
                flavor=flavor,
                seq_len=seq_len,
                titan_params=params,
                torchtitan_params=tt_params,
                titan_flops_per_token=flops,
                torchtitan_flops_per_token=tt_flops,
            )
        )
        print(
            f"| {name} | {flavor} | {seq_len} | {params:,} | {tt_params:,} | {flops:,.0f} | {tt_flops:,.0f} "
            f"| {flops / tt_flops:.4f} |"
        )
    if args.json:
        args.json.write_text(json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
    main()
