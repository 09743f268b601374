"""Chat rows through titan-data alone: row layouts and bad rows, turn masks from the whole render, and the
packed loader's exact resume (at another number of ranks and with worker processes)."""

import json

import pytest
import torch

from titan_data import (
    ChatDataset,
    ChatOptions,
    DataError,
    RowFields,
    StreamLayout,
    TokenLoader,
    load_chat_template,
    load_examples,
)
from titan_data.chat.template import ChatTemplate

ASSETS_TEMPLATE = "tokenizer"


@pytest.fixture(scope="module")
def template(llama3_tokenizer):
    from titan_data.datasets.registry import ASSETS

    return load_chat_template(ASSETS / "tokenizer")


def _conversations(count):
    out = []
    for i in range(count):
        turns = [{"role": "system", "content": f"Rule {i}."}] if i % 2 else []
        for t in range(1 + i % 3):
            turns += [
                {"role": "user", "content": f"question {i} {t} " + "word " * (i % 5)},
                {"role": "assistant", "content": f"answer {i} {t} " + "more " * (i % 7)},
            ]
        out.append({"messages": turns})
    return out


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_three_layouts_give_the_same_conversation(tmp_path, template, llama3_tokenizer):
    rows = [
        {"messages": [{"role": "user", "content": "Add 2\n\n3"}, {"role": "assistant", "content": "5"}]},
        {"question": "Add 2\n\n3", "answer": "5"},
        {"instruction": "Add 2", "input": "3", "output": "5"},
    ]
    fields = RowFields(prompt_field="question", completion_field="answer")
    examples = load_examples(
        _write(tmp_path / "c.jsonl", rows), template, llama3_tokenizer, 64, ChatOptions(fields)
    )
    assert len(examples) == 3
    for e in examples[1:]:
        assert (
            e.inputs.tolist() == examples[0].inputs.tolist()
            and e.labels.tolist() == examples[0].labels.tolist()
        )
    # trained: "5" and <|eot_id|>, nothing else
    trained = [t for t in examples[0].labels.tolist() if t != -100]
    assert llama3_tokenizer.decode(trained) == "5<|eot_id|>"


@pytest.mark.parametrize(
    "row, says",
    [
        ({"text": "x"}, "line 1: no 'messages' field"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "line 1: 'messages' has role 'robot'"),
        (
            {"messages": [{"role": "user", "content": 3}]},
            "line 1: 'messages' user turn content is int, not a string",
        ),
        ({"messages": [{"role": "user", "content": "hi"}]}, "line 1: the conversation has no assistant turn"),
        (
            {"messages": [{"role": "user", "content": "hi", "tool_calls": [{"function": {"name": "f"}}]}]},
            "line 1: 'messages' user turn has tool_calls that are not an assistant's list",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]},
            "line 1: 'messages' assistant turn content is NoneType, not a string",
        ),
        (
            {
                "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}],
                "tools": 5,
            },
            "line 1: 'tools' must be a list of tool schemas",
        ),
    ],
)
def test_a_bad_row_is_named_in_one_line_or_skipped_and_counted(
    tmp_path, template, llama3_tokenizer, row, says
):
    path = _write(tmp_path / "c.jsonl", [row, *_conversations(1)])
    with pytest.raises(DataError) as err:
        load_examples(path, template, llama3_tokenizer, 64, ChatOptions())
    assert f"{path} {says}" in str(err.value) and "\n" not in str(err.value)
    assert len(load_examples(path, template, llama3_tokenizer, 64, ChatOptions(bad_rows="skip"))) == 1


def test_a_plain_template_whose_prefixes_are_not_prefixes_is_refused(tmp_path, llama3_tokenizer):
    # no control token starts a message and the last turn is written differently from the same turn
    # followed by more: nothing says where the assistant's text is, so it is refused, not guessed
    source = "{% for m in messages %}{{ m['content'] }}{% if loop.last %}!{% endif %}{% endfor %}"
    path = _write(tmp_path / "c.jsonl", _conversations(1))
    with pytest.raises(
        DataError, match="start with no control token .*not a prefix of the whole.*generation"
    ):
        load_examples(path, ChatTemplate(source, {}, "t.jinja"), llama3_tokenizer, 64, ChatOptions())
    # with {% generation %} blocks the same plain-text layout trains exactly the marked answers
    marked = (
        "{% for m in messages %}{% if m.role == 'assistant' %}A: {% generation %}{{ m.content }}."
        "{% endgeneration %}{% else %}Q: {{ m.content }}{% endif %}\n{% endfor %}"
    )
    (example,) = load_examples(path, ChatTemplate(marked, {}, "m.jinja"), llama3_tokenizer, 64, ChatOptions())
    trained = [t for t in example.labels.tolist() if t != -100]
    assert llama3_tokenizer.decode(trained) == " answer 0 0 ."  # " answer" is one token: it holds the span


def test_a_tokenizer_without_a_template_is_refused_naming_where_it_looked(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "<s>"}')
    with pytest.raises(DataError, match="has none .*set sft.chat_template"):
        load_chat_template(tmp_path)


def test_the_template_runs_sandboxed(tmp_path):
    source = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(DataError, match="failed to render"):
        ChatTemplate(source, {}, "evil.jinja").render([{"role": "user", "content": "x"}])


def _batches(loader, count):
    it = iter(loader)
    return [[t.clone() for t in next(it)] for _ in range(count)]


def test_packed_chat_resumes_exactly_on_another_number_of_ranks_and_with_workers(
    tmp_path, template, llama3_tokenizer
):
    path = _write(tmp_path / "c.jsonl", _conversations(40))
    examples = load_examples(path, template, llama3_tokenizer, 192, ChatOptions())

    def loader(rank, world, workers=0):
        ds = ChatDataset(examples, 192, streams=StreamLayout(rank, world, 4))
        return TokenLoader(ds, 4 // world, num_workers=workers)  # the same global batch of 4 rows

    # one rank reading 4 streams, 6 batches of 4 rows, uninterrupted: the reference (several epochs of each stream)
    whole = _batches(loader(0, 1), 6)
    assert any((b[2] == 0).sum() > b[2].shape[0] for b in whole)  # rows hold several conversations
    # 2 ranks, 3 batches each, then stop: their states together resume 1 rank with 2 workers
    ranks = [loader(r, 2) for r in range(2)]
    first = [_batches(ranks[r], 3) for r in range(2)]
    state = {**ranks[0].state_dict(), **ranks[1].state_dict()}
    resumed = loader(0, 1, workers=2)
    resumed.load_state_dict(state)
    rest = _batches(resumed, 3)
    resumed.close()

    def rows(batches):
        return sorted(tuple(torch.cat(b_i).tolist()) for b in batches for b_i in zip(*b, strict=True))

    assert rows(first[0] + first[1]) == rows(whole[:3])
    assert rows(rest) == rows(whole[3:])


def test_every_field_of_a_turn_and_the_row_tools_reach_the_template(tmp_path, llama3_tokenizer):
    # a template that prints what it is given: nothing a row holds is dropped on the way
    source = (
        "{{ tools | tojson }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>"
        "{{ m | tojson }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{% endif %}"
    )
    call = {"type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    turns = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "think"},
        {"role": "tool", "content": "1", "name": "f", "tool_call_id": "c1"},
        {"role": "assistant", "content": "done", "thinking": "t"},
    ]
    tools = [{"type": "function", "function": {"name": "f"}}]
    path = _write(tmp_path / "c.jsonl", [{"messages": turns, "tools": json.dumps(tools)}])
    (example,) = load_examples(
        path, ChatTemplate(source, {}, "show.jinja"), llama3_tokenizer, 256, ChatOptions()
    )
    text = llama3_tokenizer.decode(example.inputs.tolist())
    assert all(json.dumps(t) in text for t in turns) and text.startswith(json.dumps(tools))


def test_generation_blocks_are_the_trained_tokens_as_transformers_return_assistant_tokens_mask():
    transformers = pytest.importorskip("transformers")
    from titan_data import build_tokenizer
    from titan_data.chat.masks import tokenize_conversation
    from titan_data.datasets.registry import ASSETS

    # only the answer's text is marked (not its header, not its end-of-turn token): what the header rule
    # would train differs, so the blocks decide
    marked = (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
        "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}<|eot_id|>"
        "{% else %}{{ m.content }}<|eot_id|>{% endif %}{% endfor %}"
    )
    theirs = transformers.AutoTokenizer.from_pretrained(ASSETS / "tokenizer")
    tokenizer = build_tokenizer(ASSETS / "tokenizer" / "tokenizer.json")
    template = ChatTemplate(marked, {"bos_token": "<|begin_of_text|>"}, "marked.jinja")
    for row in _conversations(6):
        messages = row["messages"]
        expected = theirs.apply_chat_template(
            messages, chat_template=marked, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ours = tokenize_conversation(messages, template, tokenizer, "assistant", "test")
        assert ours.tokens.tolist() == list(expected["input_ids"])
        assert ours.trained.astype(int).tolist() == list(expected["assistant_masks"])
        assert ours.trained.sum() > 0
