"""gpt-oss's harmony chat format through the SFT data path: the bundled `tokenizer_harmony` folder (harmony
control tokens, a harmony template) renders and tokenises as transformers' `apply_chat_template` does,
and the trained tokens are the assistant turns as the template renders them: an earlier answer up to its
<|end|>, the last one with its reasoning up to <|return|>."""

import json

import numpy as np
import pytest

from titan_data import ChatOptions, load_chat_template, load_examples
from titan_data.chat.masks import tokenize_conversation
from titan_data.datasets.registry import ASSETS
from titan_data.tokenizers.build import build_tokenizer

HARMONY = ASSETS / "tokenizer_harmony"
CONVERSATION = [
    {"role": "system", "content": "Answer in one short sentence."},
    {"role": "user", "content": "What does a tokenizer do?"},
    {"role": "assistant", "content": "It splits text into numbered pieces."},
    {"role": "user", "content": "And a chat template?"},
    {
        "role": "assistant",
        "content": "It writes the conversation as the model reads it.",
        "thinking": "The user asks about templates; keep it short.",
    },
]


@pytest.fixture(scope="module")
def harmony():
    return load_chat_template(HARMONY), build_tokenizer(HARMONY)


def _reference_mask(tokens: list[int], ids: dict[str, int], assistant: list[int]) -> np.ndarray:
    """Written from the format, not from prefix rendering: walk the <|start|>role headers; a run of
    assistant messages is one turn, trained from after its first `<|start|>assistant` through the
    <|end|> or <|return|> that closes its last message."""
    trained = np.zeros(len(tokens), dtype=bool)
    i, turn_start = 0, None
    while i < len(tokens):
        if tokens[i] == ids["<|start|>"]:
            is_assistant = tokens[i + 1 : i + 1 + len(assistant)] == assistant
            if is_assistant and turn_start is None:
                turn_start = i + 1 + len(assistant)
            elif not is_assistant:
                turn_start = None
        if tokens[i] in (ids["<|end|>"], ids["<|return|>"]) and turn_start is not None:
            trained[turn_start : i + 1] = True
        i += 1
    return trained


def test_harmony_renders_and_tokenises_as_transformers_apply_chat_template(harmony):
    # A dev dependency of the workspace, absent where titan-data is installed alone (the floor check).
    transformers = pytest.importorskip("transformers")
    template, tokenizer = harmony
    theirs = transformers.AutoTokenizer.from_pretrained(HARMONY)
    for add_generation_prompt, messages in ((False, CONVERSATION), (True, CONVERSATION[:4])):
        text = template.render(messages, add_generation_prompt=add_generation_prompt)
        expected = theirs.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert text == expected
        expected_ids = theirs.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=True
        )["input_ids"]
        assert tokenizer.encode_chat(text) == list(expected_ids)
    assert "<|channel|>analysis<|message|>The user asks" in template.render(CONVERSATION)
    assert "keep it short" not in template.render([*CONVERSATION, {"role": "user", "content": "More?"}])


def test_harmony_trains_each_assistant_turn_as_rendered_up_to_its_end_or_return(harmony):
    template, tokenizer = harmony
    conversation = tokenize_conversation(CONVERSATION, template, tokenizer, "assistant", "test")
    tokens = conversation.tokens.tolist()
    names = ("<|start|>", "<|end|>", "<|return|>", "<|channel|>")
    ids = {name: tokenizer.encode_chat(name)[0] for name in names}
    reference = _reference_mask(tokens, ids, tokenizer.encode_chat("assistant"))
    assert reference.sum() > 20
    assert np.array_equal(conversation.trained, reference)
    spans = np.flatnonzero(np.diff(np.r_[0, conversation.trained.astype(int), 0]))
    ends = [tokens[e - 1] for e in spans[1::2]]
    assert ends == [
        ids["<|end|>"],
        ids["<|return|>"],
    ]  # the earlier answer closes with <|end|>, the last with <|return|>

    last = tokenize_conversation(CONVERSATION, template, tokenizer, "last", "test")
    assert last.trained.sum() < conversation.trained.sum() and last.trained[-1]


def test_a_harmony_dataset_keeps_the_reasoning_of_its_rows(tmp_path, harmony):
    template, tokenizer = harmony
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    (example,) = load_examples(path, template, tokenizer, 512, ChatOptions())
    text = tokenizer.decode([*example.inputs.tolist(), int(example.labels[-1])])
    assert "<|channel|>analysis<|message|>The user asks about templates" in text
    assert text.endswith("<|return|>")  # the last label: the model learns to stop
