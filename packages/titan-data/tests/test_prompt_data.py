"""Prompt-only rows for GRPO: a conversation renders as transformers' apply_chat_template with the
generation prompt, text as the tokenizer frames a document, other columns are kept; an overlong prompt keeps
its last tokens or is dropped; a bad row is named or skipped. The dataset's windows repeat each step's
prompts `repeat` times, and a state saved between repeats resumes at the same window."""

import json

import pytest

from titan_data import DataError, PromptDataset, load_chat_template, load_prompts
from titan_data.datasets.registry import ASSETS

BUNDLED = ASSETS / "prompts_test" / "prompts_test.jsonl"


@pytest.fixture(scope="module")
def template():
    return load_chat_template(ASSETS / "tokenizer")


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_conversations_render_as_transformers_and_columns_are_kept(tmp_path, template, llama3_tokenizer):
    transformers = pytest.importorskip("transformers")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    path = _write(
        tmp_path / "p.jsonl", [{"prompt": messages, "answer": "#### 4"}, {"prompt": "Two plus two is"}]
    )
    conversation, text = load_prompts(path, template, llama3_tokenizer, 256)
    hf = transformers.AutoTokenizer.from_pretrained(ASSETS / "tokenizer")
    assert conversation.ids.tolist() == hf.apply_chat_template(
        messages, add_generation_prompt=True, return_dict=False
    )
    assert conversation.columns == {"answer": "#### 4"} and conversation.conversational
    assert text.ids.tolist() == hf("Two plus two is")["input_ids"] and not text.conversational


def test_overlong_prompts_keep_their_end_or_are_dropped_and_bad_rows_are_named(
    tmp_path, template, llama3_tokenizer
):
    rows = [{"prompt": "word " * 40}, {"prompt": "short"}]
    path = _write(tmp_path / "p.jsonl", rows)
    full = load_prompts(path, template, llama3_tokenizer, 256)[0].ids
    kept = load_prompts(path, template, llama3_tokenizer, 8)
    assert [p.ids.tolist() for p in kept] == [
        full[-8:].tolist(),
        load_prompts(path, template, llama3_tokenizer, 256)[1].ids.tolist(),
    ]
    assert len(load_prompts(path, template, llama3_tokenizer, 8, overlong="drop")) == 1
    bad = _write(tmp_path / "bad.jsonl", [{"prompt": "fine"}, {"question": "no prompt"}])
    with pytest.raises(DataError, match=r"bad.jsonl.*line 2.*no 'prompt' field"):
        load_prompts(bad, template, llama3_tokenizer, 64)
    assert len(load_prompts(bad, template, llama3_tokenizer, 64, bad_rows="skip")) == 1


def test_windows_repeat_each_steps_prompts_and_resume_between_repeats(template, llama3_tokenizer):
    prompts = load_prompts(BUNDLED, template, llama3_tokenizer, 48)[:10]

    def order(dataset, n):
        return [int(w[2, 0]) for _, w in zip(range(n), dataset.windows(), strict=False)]

    repeated = PromptDataset(prompts, 48, repeat=3, chunk=2)
    assert order(repeated, 12) == [0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3]
    head = PromptDataset(prompts, 48, repeat=3, chunk=2)
    order(head, 4)  # stopped between the repeats of the first step's prompts
    again = PromptDataset(prompts, 48, repeat=3, chunk=2)
    again.load_state_dict(head.state_dict())
    assert order(again, 8) == [0, 1, 2, 3, 2, 3, 2, 3]
    window = next(iter(PromptDataset(prompts, 48).windows()))
    n = len(prompts[0].ids)
    assert window[0, :n].tolist() == prompts[0].ids.tolist() and window[1].sum() == n
