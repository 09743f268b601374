"""The numbers a fine-tuner reads: the trainable share at start, trained tokens per second, one metrics.jsonl
line per step across a resume, and plain text in a piped log.

The base is a tiny Llama saved by transformers (tests/fixtures/hf_instruct.py). References: peft's own count
of a LoRA model's parameters, and the labels of the run's first batch as Titan's loader makes them.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from titan_train.cli import run
from titan_train.config import load_job_config
from titan_train.wiring.data import build_loader, build_tokenizer_for
from titan_train.wiring.valid_token_loss import IGNORE_INDEX

REPO = Path(__file__).resolve().parents[1]
CHAT_FILE = (
    REPO / "packages" / "titan-data" / "src" / "titan_data" / "assets" / "chat_test" / "chat_test.jsonl"
)
_spec = importlib.util.spec_from_file_location("hf_instruct", REPO / "tests" / "fixtures" / "hf_instruct.py")
hf_instruct = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf_instruct)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return hf_instruct.write_instruct_folder(tmp_path_factory.mktemp("numbers") / "base")


def _flags(base: Path, dump: Path, *more: str) -> list[str]:
    return [
        *("--job.dump_folder", str(dump), "--model.name", "llama3", "--model.flavor", "from_hf"),
        *("--model.hf_assets_path", str(base), "--checkpoint.enable", "--checkpoint.initial_load_in_hf"),
        *("--training.dataset", "chat", "--training.dataset_path", str(CHAT_FILE), "--training.seq_len", "64"),
        *("--training.local_batch_size", "2", "--activation_checkpoint.mode", "none", "--metrics.log_freq", "1"),
        *("--lr_scheduler.warmup_steps", "0", *more),
    ]  # fmt: skip


def _records(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def test_lora_trainable_count_is_peft_s_and_trained_tps_counts_only_label_tokens(tmp_path, base, caplog):
    lora = ("--model.converters", "lora", "--lora.rank", "4", "--lora.target_modules", "all-linear")
    flags = _flags(base, tmp_path / "run", "--training.steps", "1", "--sft.loss_on", "assistant", *lora)
    with caplog.at_level(logging.INFO):
        assert run(flags) == 0
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("parameters: ")]

    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=4, target_modules="all-linear")
    )
    trainable, total = peft_model.get_nb_trainable_parameters()
    assert line == f"parameters: {total:,} ({trainable:,} trainable, {100 * trainable / total:.2f}%)"
    assert 0 < trainable < total / 10

    # The step's batch, as the run's loader makes it: its labels that count against all its tokens.
    config = load_job_config(flags)
    loader = build_loader(config, build_tokenizer_for(config), 0, 1)
    _, labels, *_ = next(iter(loader))
    loader.close()
    trained = int((labels != IGNORE_INDEX).sum())
    assert 0 < trained < labels.numel()  # masked turns: the two rates differ
    (record,) = _records(tmp_path / "run")
    assert record["trained_tps"] / record["tps"] == pytest.approx(trained / labels.numel(), rel=1e-9)


def test_a_resumed_run_writes_each_step_once_and_a_piped_log_has_no_colour_codes(tmp_path, base):
    dump = tmp_path / "run"
    flags = _flags(base, dump, "--training.steps", "4", "--checkpoint.interval", "2")
    assert run(flags) == 0
    assert [r["step"] for r in _records(dump)] == [1, 2, 3, 4]
    first = _records(dump)
    # Killed after logging steps 3 and 4 but before their checkpoint (a torn line too): the run resumes at 2.
    shutil.rmtree(dump / "checkpoint" / "step-4")
    with (dump / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "lo')
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("FORCE_COLOR", None)
    done = subprocess.run(
        [sys.executable, "-m", "titan_train.cli", *flags],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "resuming from step-2" in done.stdout and "trained_tps: " in done.stdout
    assert "\x1b" not in done.stdout + done.stderr
    again = _records(dump)
    assert [r["step"] for r in again] == [1, 2, 3, 4]
    assert [r["loss"] for r in again] == pytest.approx([r["loss"] for r in first], rel=1e-5)
