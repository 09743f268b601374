"""DPO on Qwen3.5 with packed pairs: several pairs to a row (the linear layers' convolution and delta-rule
state restarting at each sequence, found from positions restarting at 0) train as TRL's DPOTrainer trains the
same pairs, each sequence in a row of its own: loss, grad_norm and TRL's reward and log-prob metrics within
1e-4 relative at every step. The model is a 4-block Qwen3.5 (3 linear, 1 full) saved by transformers, with
test_preference_trl's ChatML tokenizer; a step is one epoch of the pairs (the full batch, as TRL's)."""

from __future__ import annotations

import json

import pytest
from test_preference_trl import METRICS, STEPS, _close, chatml_model, preference_rows, titan_run, trl_run
from tiny_qwen3_5 import random_text_model

from titan_data import PreferenceDataset, build_tokenizer, load_chat_template, load_pairs

SEQ_LEN = "256"


@pytest.fixture(scope="module")
def qwen3_5_folder(tmp_path_factory):
    """ChatML's tokenizer and template beside a random Qwen3.5's config and weights (replacing the Llama's)."""
    folder = chatml_model(tmp_path_factory.mktemp("qwen3_5_chatml"))
    random_text_model(seed=0).save_pretrained(folder)
    return folder


def _windows(folder, data) -> int:
    """Rows in one epoch of the pairs packed into rows of SEQ_LEN."""
    pairs = load_pairs(data, load_chat_template(folder), build_tokenizer(folder), int(SEQ_LEN), packing=True)
    return sum(1 for _ in PreferenceDataset(pairs, int(SEQ_LEN), packing=True, infinite=False).windows())


def test_packed_dpo_steps_equal_trls_dpo_trainer_on_each_sequence_alone(tmp_path, qwen3_5_folder, one_rank):
    """8 pairs in 3 rows of 256: loss within 5.1e-7 relative, grad_norm 1.4e-6, the metrics 2.9e-7 (2026-12-02).
    Planted: the delta-rule state not emptied where a packed sequence starts put step 1's grad_norm 6.4e-3 off."""
    rows = preference_rows(count=8)
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    windows = _windows(qwen3_5_folder, data)
    assert windows < len(rows) // 2  # most rows hold more than one pair
    packing = (
        "--sft.packing",
        "true",
        "--training.seq_len",
        SEQ_LEN,
        "--training.local_batch_size",
        str(windows),
    )
    titan = titan_run(qwen3_5_folder, tmp_path, one_rank, "packed", rows, "--model.name", "qwen3_5", *packing)
    theirs = [log for log in trl_run(qwen3_5_folder, tmp_path, rows, ["sigmoid"]) if "loss" in log]
    assert len(titan) == len(theirs) == STEPS
    for step, (ours, ref) in enumerate(zip(titan, theirs, strict=True), 1):
        for key in ("loss", "grad_norm", *METRICS):
            assert _close(ours[key], ref[key]), (step, key, ours[key], ref[key])
    assert titan[-1]["rewards/margins"] != 0  # it trained
