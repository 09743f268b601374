"""Preference rows as pairs: TRL's three layouts give the same tokens, only completion tokens are
trained (checked against transformers' apply_chat_template on the same rows), each bad row is named in
one line (file, row, field) or skipped and counted, and windows keep every pair whole, packed or padded."""

import json
import logging

import numpy as np
import pytest

from titan_data import DataError, PreferenceDataset, StreamLayout, load_chat_template, load_pairs
from titan_data.chat.dataset import IGNORE
from titan_data.datasets.registry import ASSETS
from titan_data.preference.dataset import NO_SEQUENCE

BUNDLED = ASSETS / "preference_test" / "preference_test.jsonl"
PROMPT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is two plus two?"}]
CHOSEN = [{"role": "assistant", "content": "Two plus two is 4."}]
REJECTED = [{"role": "assistant", "content": "It is 5, I think."}]


@pytest.fixture(scope="module")
def template():
    return load_chat_template(ASSETS / "tokenizer")


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _load(path, template, tokenizer, **kw):
    return load_pairs(path, template, tokenizer, 128, **{"packing": True, **kw})


def test_the_three_layouts_give_the_same_pair(tmp_path, template, llama3_tokenizer):
    plain_prompt = [{"role": "user", "content": "What is two plus two?"}]
    rows = [
        {"prompt": plain_prompt, "chosen": CHOSEN, "rejected": REJECTED},
        {
            "prompt": "What is two plus two?",
            "chosen": CHOSEN[0]["content"],
            "rejected": REJECTED[0]["content"],
        },
        {"chosen": plain_prompt + CHOSEN, "rejected": plain_prompt + REJECTED},
    ]
    pairs = _load(_write(tmp_path / "p.jsonl", rows), template, llama3_tokenizer)
    for pair in pairs[1:]:
        for side in ("chosen", "rejected"):
            np.testing.assert_array_equal(getattr(pair, side).inputs, getattr(pairs[0], side).inputs)
            np.testing.assert_array_equal(getattr(pair, side).labels, getattr(pairs[0], side).labels)


def test_only_the_completion_is_trained_as_transformers_renders_it(tmp_path, template, llama3_tokenizer):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(ASSETS / "tokenizer")
    (pair,) = _load(
        _write(tmp_path / "p.jsonl", [{"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED}]),
        template,
        llama3_tokenizer,
    )
    prompt_ids = list(
        hf.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True, return_dict=False)
    )
    for example, completion in ((pair.chosen, CHOSEN), (pair.rejected, REJECTED)):
        whole = list(hf.apply_chat_template(PROMPT + completion, tokenize=True, return_dict=False))
        assert whole[: len(prompt_ids)] == prompt_ids
        assert example.inputs.tolist() == whole[:-1]
        trained = [t for t in example.labels.tolist() if t != IGNORE]
        assert trained == whole[len(prompt_ids) :]  # the answer and its <|eot_id|>, nothing of the prompt


BAD = [
    ({"prompt": PROMPT, "rejected": REJECTED}, "row 0: no 'chosen' field"),
    ({"prompt": PROMPT, "chosen": CHOSEN}, "row 0: no 'rejected' field"),
    (
        {"prompt": PROMPT, "chosen": [{"role": "robot", "content": "4"}], "rejected": REJECTED},
        "'chosen' has role 'robot'",
    ),
    ({"prompt": PROMPT, "chosen": CHOSEN, "rejected": CHOSEN}, "'rejected' is the same as 'chosen'"),
    (
        {"prompt": PROMPT, "chosen": [{"role": "assistant", "content": " "}], "rejected": REJECTED},
        "'chosen' is an empty completion",
    ),
    ({"prompt": "Hi", "chosen": "", "rejected": "Hello"}, "'chosen' is an empty completion"),
    ({"chosen": PROMPT + CHOSEN, "rejected": PROMPT + CHOSEN}, "'rejected' is the same as 'chosen'"),
    (
        {"prompt": PROMPT, "chosen": CHOSEN, "rejected": [{"role": "user", "content": "no"}]},
        "'rejected' has no assistant turn",
    ),
]


@pytest.mark.parametrize("row, says", BAD, ids=[says for _, says in BAD])
def test_a_bad_row_is_named_in_one_line_or_skipped_and_counted(
    tmp_path, template, llama3_tokenizer, caplog, row, says
):
    good = {"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([row, good]))
    with pytest.raises(DataError) as err:
        _load(path, template, llama3_tokenizer)
    message = str(err.value)
    assert "\n" not in message and str(path) in message and says in message, message
    with caplog.at_level(logging.INFO):
        pairs = _load(path, template, llama3_tokenizer, bad_rows="skip")
    assert len(pairs) == 1 and any("1 bad rows skipped" in r.getMessage() for r in caplog.records)


def _windows(dataset, count):
    it = dataset.windows()
    return [next(it) for _ in range(count)]


@pytest.mark.parametrize("packing", [True, False])
def test_windows_hold_whole_pairs_with_positions_restarting(template, llama3_tokenizer, packing):
    pairs = load_pairs(BUNDLED, template, llama3_tokenizer, 128, packing=packing)
    assert len(pairs) == 96
    dataset = PreferenceDataset(pairs, 128, packing=packing, infinite=False)
    seen = 0
    for window in dataset.windows():
        inputs, labels, positions, sequence = window
        assert window.shape == (4, 128 if packing else 256)
        ids = sorted(set(sequence.tolist()) - {NO_SEQUENCE})
        assert ids == list(range(len(ids))) and len(ids) % 2 == 0  # whole pairs: chosen 2k, rejected 2k + 1
        for k in range(0, len(ids), 2):
            pair = pairs[seen + k // 2]
            for side, example in ((k, pair.chosen), (k + 1, pair.rejected)):
                where = sequence == side
                np.testing.assert_array_equal(inputs[where], example.inputs)
                np.testing.assert_array_equal(labels[where], example.labels)
                np.testing.assert_array_equal(positions[where], np.arange(len(example.inputs)))
        assert (labels[sequence == NO_SEQUENCE] == IGNORE).all()
        seen += len(ids) // 2
    assert seen == len(pairs)


def test_pairs_are_dealt_to_streams_and_resume_exactly(template, llama3_tokenizer):
    pairs = load_pairs(BUNDLED, template, llama3_tokenizer, 128, packing=True)
    whole = PreferenceDataset(pairs, 128, streams=StreamLayout(0, 1, 2))
    first = _windows(whole, 5)
    state = whole.state_dict()
    after = _windows(whole, 3)
    resumed = PreferenceDataset(pairs, 128, streams=StreamLayout(0, 1, 2))
    resumed.load_state_dict(state)
    for a, b in zip(_windows(resumed, 3), after, strict=True):
        np.testing.assert_array_equal(a, b)
    assert len(first) == 5


@pytest.mark.parametrize("packing", [True, False])
def test_a_fifth_row_keys_each_position_by_its_pairs_index_in_the_dataset(
    template, llama3_tokenizer, packing
):
    """With pair_index, over 3 streams (pair i in stream i % 3, so windows do not follow the list's order),
    every sequence's positions hold the index in `pairs` of the pair whose tokens they are, -1 on padding;
    each pair appears once in a pass. The first four rows are the windows without it."""
    pairs = load_pairs(BUNDLED, template, llama3_tokenizer, 128, packing=packing)
    keyed = PreferenceDataset(pairs, 128, packing=packing, infinite=False, pair_index=True,
                              streams=StreamLayout(0, 1, 3))  # fmt: skip
    plain = PreferenceDataset(pairs, 128, packing=packing, infinite=False, streams=StreamLayout(0, 1, 3))
    seen = []
    for window, without in zip(keyed.windows(), plain.windows(), strict=True):
        inputs, _, _, sequence, index = window
        np.testing.assert_array_equal(window[:4], without)
        assert ((index == -1) == (sequence == NO_SEQUENCE)).all()
        for k in range(0, int(sequence.max()) + 1, 2):
            (i,) = set(index[sequence == k].tolist()) | set(index[sequence == k + 1].tolist())
            np.testing.assert_array_equal(inputs[sequence == k], pairs[i].chosen.inputs)
            np.testing.assert_array_equal(inputs[sequence == k + 1], pairs[i].rejected.inputs)
            seen.append(i)
    assert sorted(seen) == list(range(len(pairs))) and (seen != sorted(seen)) == packing
