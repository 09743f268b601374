"""GRPO learning curves: Titan's `debug_grpo.toml` task against TRL's GRPOTrainer on the same model and data.

One Llama 3 `debugmodel`-shaped model (random weights from Titan's `init_weights(seed=0)`) is saved by
transformers beside the bundled tokenizer and chat template; both trainers start from it, on the bundled
arithmetic prompts (`prompts_test`, in order), with the same rewards (Titan's built-ins `answer_match` and
`number_format`, handed to TRL as Python functions), 2 prompts x 8 completions of at most 8 tokens a step,
temperature 1, dapo, beta 0, AdamW at a constant lr without weight decay, clipping at 1. Titan runs as
`titan-train` (a subprocess, the titan engine generating), then TRL in this process (transformers'
generate). The two sample with different generators, so the curves agree in trend, not token for token
(tests/test_grpo_trl.py is the exact comparison, on the same rollouts). Prints the mean reward per block
of steps for each, and seconds per step with their ratio.

    uv run python bench/grpo_vs_trl.py [--steps 30] [--block 5] [--threads 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
PROMPTS = REPO / "packages/titan-data/src/titan_data/assets/prompts_test/prompts_test.jsonl"
TOKENIZER = REPO / "packages/titan-data/src/titan_data/assets/tokenizer"
B, G, COMPLETION, LR = 16, 8, 8, 3e-3


def save_model(folder: Path) -> None:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from titan_models import LlamaStateDictAdapter, Transformer, llama3_args, to_hf_config

    args = llama3_args("debugmodel")
    with torch.device("meta"):
        ours = Transformer(args)
    ours.to_empty(device="cpu")
    ours.init_weights(seed=0)
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    ends = [tokenizer.convert_tokens_to_ids(t) for t in ("<|eot_id|>", "<|end_of_text|>")]
    config = {**to_hf_config(args), "bos_token_id": tokenizer.bos_token_id, "eos_token_id": ends}
    hf = LlamaForCausalLM(LlamaConfig(**config))
    hf.load_state_dict(
        LlamaStateDictAdapter(args).to_hf(ours.state_dict()), strict=not args.tie_word_embeddings
    )
    hf.generation_config.eos_token_id = ends
    hf.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TOKENIZER / name, folder / name)


def titan_run(folder: Path, out: Path, steps: int, threads: int) -> list[dict]:
    dump = out / "titan"
    flags = [
        "--job.config_file", str(REPO / "apps/configs/debug_grpo.toml"),
        "--job.dump_folder", str(dump),
        "--model.flavor", "from_hf", "--model.hf_assets_path", str(folder),
        "--checkpoint.enable", "--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", str(folder),
        "--checkpoint.interval", "100000",
        "--training.steps", str(steps), "--metrics.log_freq", "1", "--metrics.disable_color_printing",
        "--lr_scheduler.warmup_steps", "0", "--lr_scheduler.decay_ratio", "0",
        "--optimizer.lr", str(LR), "--optimizer.weight_decay", "0", "--optimizer.beta2", "0.999",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "titan_train.cli", *flags], cwd=REPO, capture_output=True, text=True, env=env
    )
    if done.returncode:
        raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    records[0]["wall_s"] = time.perf_counter() - started
    return records


def trl_run(folder: Path, out: Path, steps: int) -> list[dict]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from titan_train.objectives.rewards import answer_match, number_format

    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    logs: list[dict] = []
    last = [time.perf_counter()]

    class Keep(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                now = time.perf_counter()
                kept.append(dict(logs, step=state.global_step, step_time_s=now - last[0]))
                last[0] = now

    kept = logs
    args = GRPOConfig(
        output_dir=str(out / "trl"),
        per_device_train_batch_size=B,
        num_generations=G,
        max_completion_length=COMPLETION,
        max_steps=steps,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=0,
        shuffle_dataset=False,
        temperature=1.0,
        loss_type="dapo",
    )
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.pad_token = "<|end_of_text|>"
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
        reward_funcs=[answer_match, number_format],
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[Keep()],
    )
    trainer.train()
    return logs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--block", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="keep the runs' folders here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = args.out or Path(tempfile.mkdtemp(prefix="grpo_vs_trl_"))
    folder = out / "model"
    folder.mkdir(parents=True, exist_ok=True)
    save_model(folder)
    titan = titan_run(folder, out, args.steps, args.threads)
    trl = trl_run(folder, out, args.steps)
    (out / "curves.json").write_text(json.dumps({"titan": titan, "trl": trl}))
    print("| steps | Titan reward | TRL reward | Titan number_format | TRL number_format |")
    print("|---|---|---|---|---|")
    for start in range(0, args.steps, args.block):
        t, r = titan[start : start + args.block], trl[start : start + args.block]

        def mean(rows, key):
            return sum(x[key] for x in rows) / len(rows)

        key = "rewards/number_format/mean"
        print(
            f"| {start + 1}-{start + len(t)} | {mean(t, 'reward'):.3f} | {mean(r, 'reward'):.3f} "
            f"| {mean(t, key):.3f} | {mean(r, key):.3f} |"
        )
    titan_s = sum(x["step_time_s"] for x in titan[1:]) / (len(titan) - 1)
    trl_s = sum(x["step_time_s"] for x in trl[1:]) / (len(trl) - 1)
    tps = sum(x["rollout_tps"] for x in titan[1:]) / (len(titan) - 1)
    print(
        f"\nseconds per step after the first: Titan {titan_s:.3f}, TRL {trl_s:.3f}, ratio TRL/Titan {trl_s / titan_s:.2f}"
    )
    print(f"Titan engine rollout tokens/s (mean over steps 2-{args.steps}): {tps:.0f}")
    print(f"runs kept in {out}")


if __name__ == "__main__":
    main()
