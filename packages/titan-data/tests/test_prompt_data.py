"""Prompt-only rows for GRPO: a conversation renders as transformers' apply_chat_template with the
generation prompt, text as the tokenizer frames a document, other columns are kept; an overlong prompt keeps
its last tokens or is dropped; a bad row is named or skipped. The dataset's windows repeat each step's
prompts `repeat` times, and a state saved between repeats resumes at the same window."""

import json

import pytest

from titan_data import DataError, PromptDataset, PromptFields, load_chat_template, load_prompts
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


def _gsm8k_repository(root):
    """A local copy of a dataset repository laid out as openai/gsm8k is on the Hub: a README whose YAML
    names two configurations (main, the default, and socratic), each a folder of train and test parquet
    files with `question` and `answer` columns."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    readme = ["---", "configs:"]
    for config in ("main", "socratic"):
        readme += [f"- config_name: {config}"] + ["  default: true"] * (config == "main")
        readme += ["  data_files:"]
        for split in ("train", "test"):
            readme += [f"  - split: {split}", f"    path: {config}/{split}-*"]
            rows = [
                {"question": f"{config} {split}: what is {a} plus {a}?", "answer": f"{a} + {a}\n#### {2 * a}"}
                for a in range(3 if split == "train" else 2)
            ]
            (root / config).mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.Table.from_pylist(rows), root / config / f"{split}-00000-of-00001.parquet")
    (root / "README.md").write_text("\n".join([*readme, "---", "", "GSM8K-shaped rows for a test."]) + "\n")
    return root


def test_a_hub_dataset_by_configuration_split_and_column_framed_as_a_chat(
    tmp_path, template, llama3_tokenizer
):
    """GSM8K's rows as the Hub publishes them: `question` text framed as a user turn after a system turn,
    rendered as transformers' apply_chat_template renders that conversation; the configuration and split
    chosen are the ones read (planted: the configuration not passed to `datasets` reads main's rows and
    fails); plain text with a system prompt but no user-turn framing is refused, naming the fix."""
    transformers = pytest.importorskip("transformers")
    repo = _gsm8k_repository(tmp_path / "gsm8k")
    system = "Reason step by step, then give the answer after ####."
    fields = PromptFields("question", text_as_turn=True, system=system)
    prompts = load_prompts(
        repo, template, llama3_tokenizer, 256, fields=fields, split="test", config="socratic"
    )
    hf = transformers.AutoTokenizer.from_pretrained(ASSETS / "tokenizer")
    expected = [
        hf.apply_chat_template(
            [
                {"role": "system", "content": system},
                {"role": "user", "content": f"socratic test: what is {a} plus {a}?"},
            ],
            add_generation_prompt=True,
            return_dict=False,
        )
        for a in range(2)
    ]
    assert [p.ids.tolist() for p in prompts] == expected
    assert [p.columns for p in prompts] == [{"answer": f"{a} + {a}\n#### {2 * a}"} for a in range(2)]
    assert prompts[0].prompt[0] == {"role": "system", "content": system} and prompts[0].conversational
    default = load_prompts(repo, template, llama3_tokenizer, 256, fields=PromptFields("question"))
    assert [p.prompt for p in default] == [f"main train: what is {a} plus {a}?" for a in range(3)]
    assert default[0].ids.tolist() == hf(default[0].prompt)["input_ids"]  # raw text, TRL's way
    with pytest.raises(DataError, match=r"'question' is plain text.*grpo.text_prompts = 'user_turn'"):
        load_prompts(repo, template, llama3_tokenizer, 256, fields=PromptFields("question", system=system))
    with pytest.raises(DataError, match=r"configuration 'nope'.*dataset_config"):
        load_prompts(repo, template, llama3_tokenizer, 256, fields=fields, config="nope")
