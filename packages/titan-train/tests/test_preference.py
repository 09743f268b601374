"""Preference tuning through the trainer, one process: the same pairs give the same steps packed,
padded and accumulated over micro-batches (the step's loss is the mean over its pairs whatever the
layout); LoRA's reference (the base with adapters switched off) trains as an explicit frozen copy does and
the run ends in a PEFT adapter and a merged Hugging Face export, as SFT does;
QLoRA DPO trains; a run killed after a checkpoint resumes with the same losses, its reference included.
The tiny Llama is saved by transformers (tiny_llama.py) with the bundled Llama 3 tokenizer and template;
the pairs are the first 8 of the bundled preference file (TRL's three layouts)."""

import json
import shutil
from pathlib import Path

import pytest
from tiny_llama import from_hf_flags, save_tiny_llama

import titan_train.objectives.preference as preference_objective
from titan_data import PreferenceDataset, build_tokenizer, load_chat_template, load_pairs
from titan_train.config import load_job_config
from titan_train.objectives.preference_step import METRICS
from titan_train.plan import resolve
from titan_train.torchrun import run_torchrun
from titan_train.trainer import Trainer
from titan_train.wiring.data import BUNDLED_TOKENIZER
from titan_train.wiring.lora_export import PEFT_FOLDER, PEFT_WEIGHTS

BUNDLED = BUNDLED_TOKENIZER.parent / "preference_test" / "preference_test.jsonl"
PAIRS, SEQ_LEN, STEPS = 8, 128, 4
KEYS = ("loss", "grad_norm", *METRICS)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dpo_model")
    save_tiny_llama(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(BUNDLED_TOKENIZER / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(BUNDLED.read_text().splitlines(keepends=True)[:PAIRS]))
    return path


def _flags(folder, data, dump, *more):
    return [
        *from_hf_flags(folder, dump),
        "--training.dataset", "preference",
        "--training.dataset_path", str(data),
        "--training.seq_len", str(SEQ_LEN),
        "--training.steps", str(STEPS),
        "--lr_scheduler.decay_ratio", "0",
        "--optimizer.lr", "3e-3",
        "--preference.beta", "0.5",
        *more,
    ]  # fmt: skip


def _run(folder, data, dump, info, *more):
    Trainer(resolve(load_job_config(_flags(folder, data, dump, *more)), 1, "cpu"), info).train()
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def _assert_same_steps(run, reference, rel):
    assert len(run) == len(reference) == STEPS
    for step, (got, want) in enumerate(zip(run, reference, strict=True), 1):
        for key in KEYS:
            assert got[key] == pytest.approx(want[key], rel=rel, abs=1e-6), (step, key)


def _packed_rows(folder, data):
    """Windows in one epoch of the pairs packed into rows of SEQ_LEN: the full batch."""
    tokenizer = build_tokenizer(folder)
    pairs = load_pairs(data, load_chat_template(folder), tokenizer, SEQ_LEN, packing=True)
    assert len(pairs) == PAIRS
    return sum(1 for _ in PreferenceDataset(pairs, SEQ_LEN, packing=True, infinite=False).windows())


@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "orpo"])
def test_packed_padded_and_accumulated_steps_are_the_same(tmp_path, model_folder, data, one_rank, loss):
    rows = _packed_rows(model_folder, data)
    assert rows < PAIRS  # packing put several pairs in a row
    flags = ("--preference.loss", loss)
    padded = _run(
        model_folder, data, tmp_path / "padded", one_rank, *flags, "--sft.packing", "false",
        "--training.local_batch_size", str(PAIRS),
    )  # fmt: skip
    packed = _run(
        model_folder, data, tmp_path / "packed", one_rank, *flags, "--training.local_batch_size", str(rows)
    )
    assert len({r["loss"] for r in padded}) == STEPS and padded[-1]["rewards/margins"] != 0
    _assert_same_steps(packed, padded, rel=2e-5)
    accumulated = _run(  # 4 micro-batches of 2 pairs
        model_folder, data, tmp_path / "accumulated", one_rank, *flags, "--sft.packing", "false",
        "--training.local_batch_size", "2", "--training.global_batch_size", str(PAIRS),
    )  # fmt: skip
    _assert_same_steps(accumulated, padded, rel=2e-5)


LORA = ("--model.converters", "lora", "--lora.target_modules", "all-linear", "--lora.rank", "4")


def test_lora_reference_with_adapters_off_trains_as_a_frozen_copy(tmp_path, model_folder, data, one_rank):
    batch = ("--sft.packing", "false", "--training.local_batch_size", str(PAIRS))
    off = _run(model_folder, data, tmp_path / "off", one_rank, *LORA, *batch, "--checkpoint.last_save_in_hf")
    exported = tmp_path / "off" / "checkpoint" / f"step-{STEPS}"
    assert (exported / PEFT_FOLDER / PEFT_WEIGHTS).is_file()  # the adapters, as SFT exports them
    assert (exported / "model.safetensors.index.json").is_file()  # the merged Hugging Face export
    copy = _run(
        model_folder, data, tmp_path / "copy", one_rank, *LORA, *batch, "--preference.reference", "copy"
    )
    _assert_same_steps(off, copy, rel=1e-6)
    assert off[-1]["rewards/margins"] > off[0]["rewards/margins"]
    precompute = _run(
        model_folder, data, tmp_path / "pre", one_rank, *LORA, *batch, "--preference.reference", "precompute"
    )
    _assert_same_steps(precompute, off, rel=1e-6)  # the pass ran the base with adapters off
    qlora = _run(
        model_folder,
        data,
        tmp_path / "qlora",
        one_rank,
        *LORA,
        *batch,
        "--lora.quantize_base",
        "nf4",
        "--lora.nf4_scaler_block_size",
        "32",
    )
    assert qlora[-1]["loss"] < qlora[0]["loss"] and qlora[-1]["rewards/margins"] > 0


def test_a_killed_run_resumes_with_the_same_losses_and_reference(tmp_path, model_folder, data, one_rank):
    """Saving every 2 steps; a copy of the folder without step-4 is a run killed after step 2. Resumed,
    steps 3 and 4 log the same losses and rewards: the reference came back from the checkpoint, not from
    the resumed weights (which would make step 3's rewards 0)."""
    flags = ("--checkpoint.interval", "2", "--training.local_batch_size", "2")
    straight = _run(model_folder, data, tmp_path / "straight", one_rank, *flags)
    shutil.copytree(
        tmp_path / "straight" / "checkpoint" / "step-2", tmp_path / "killed" / "checkpoint" / "step-2"
    )
    resumed = _run(model_folder, data, tmp_path / "killed", one_rank, *flags)
    assert [r["step"] for r in resumed] == [3, 4]
    for got, want in zip(resumed, straight[2:], strict=True):
        for key in KEYS:
            assert got[key] == want[key], key


def test_precomputed_reference_equals_the_frozen_copy_and_resumes_without_a_second_pass(
    tmp_path, model_folder, data, one_rank, monkeypatch
):
    """`reference = "precompute"`: every pair's reference log-probs computed once before step 1 and read by
    the pair's dataset index give the steps the frozen copy gives (2 pairs a micro-batch, two streams, so a
    window's pairs are not the dataset's in order); no frozen copy is built; a run killed after step 2
    resumes steps 3-4 bit for bit from the table in its checkpoint, with no second pass."""
    passes = []
    real_pass = preference_objective.precompute_reference
    monkeypatch.setattr(
        preference_objective, "precompute_reference", lambda *a, **k: passes.append(1) or real_pass(*a, **k)
    )
    built = []
    real_build = preference_objective.build_reference
    monkeypatch.setattr(
        preference_objective, "build_reference", lambda *a: built.append(out := real_build(*a)) or out
    )
    flags = (
        "--training.local_batch_size", "2", "--sft.packing", "false",
        "--training.dataloader.num_streams", "2", "--checkpoint.interval", "2",
    )  # fmt: skip
    copy = _run(model_folder, data, tmp_path / "copy", one_rank, *flags, "--preference.reference", "copy")
    assert passes == [] and built[-1] is not None
    precompute = ("--preference.reference", "precompute")
    straight = _run(model_folder, data, tmp_path / "straight", one_rank, *flags, *precompute)
    assert passes == [1] and built[-1] is None  # one pass, no frozen copy
    _assert_same_steps(straight, copy, rel=1e-6)
    assert straight[-1]["rewards/margins"] > 0
    shutil.copytree(
        tmp_path / "straight" / "checkpoint" / "step-2", tmp_path / "killed" / "checkpoint" / "step-2"
    )
    resumed = _run(model_folder, data, tmp_path / "killed", one_rank, *flags, *precompute)
    assert passes == [1]  # the table came back from the checkpoint
    assert [r["step"] for r in resumed] == [3, 4]
    for got, want in zip(resumed, straight[2:], strict=True):
        for key in KEYS:
            assert got[key] == want[key], key


@pytest.mark.slow
def test_precomputed_reference_under_fsdp_2_equals_the_frozen_copy(tmp_path, model_folder, data):
    """Two gloo ranks, FSDP 2: the pass over the 8 pairs in batches of 3 gives rank 0 two batches and rank
    1 one (it repeats one, dropped, so the sharded layers' gathers meet); the summed table gives the
    frozen copy's steps."""
    worker = Path(__file__).parent / "workers" / "preference_precompute.py"
    env = {"PYTHONPATH": str(Path(__file__).parent)}
    result = run_torchrun(
        str(worker), str(model_folder), str(data), str(tmp_path), nproc=2, timeout=600, env=env
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    runs = json.loads((tmp_path / "result.json").read_text())
    assert runs["copy"]["copy_built"] and not runs["precompute"]["copy_built"]
    copy, precompute = ([json.loads(line) for line in runs[k]["metrics"].splitlines()] for k in runs)
    assert len(copy) == 3 and copy[-1]["rewards/margins"] != 0
    for got, want in zip(precompute, copy, strict=True):
        for key in KEYS:
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-6), key
