"""Chat fine-tuning on tokenizer folders laid out as the Hub publishes them, with the chat templates as
published (Qwen3, Llama 3.1, gpt-oss's harmony; the template files beside this test are those models'
own), on multi-turn conversations with reasoning, tool calls and tool replies.

Each folder's tokenizer is a tiny byte-level BPE trained here with the `tokenizers` library, with the
family's control tokens (Qwen3's has no BOS, as published). The reference is transformers alone:
`apply_chat_template` renders the whole conversation, the test finds the assistant blocks in that text
with the family's own header and end markers (written here from the formats), and marks the tokens
holding them with transformers' `char_to_token`. Titan's mask must equal it, and Titan's step-1 loss on a
tiny model saved by transformers must equal transformers' masked loss on the same ids.
"""

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoTokenizer,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from titan_data import PromptFields, build_tokenizer, load_chat_template, load_prompts
from titan_data.chat.masks import tokenize_conversation
from titan_data.chat.prompt import end_of_turn_id
from titan_train.config import load_job_config
from titan_train.plan import resolve
from titan_train.trainer import Trainer

TEMPLATES = Path(__file__).parent / "published_chat_templates"
VOCAB = 512

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name"}},
            "required": ["city"],
        },
    },
}


def _call(city: str) -> list[dict]:
    return [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}]


@dataclass(frozen=True)
class Family:
    """A published layout: its template file, control tokens, tokenizer_config and model."""

    model_name: str
    end_of_turn: str  # where `generate --chat` stops: what closes the last answer
    template: str
    special: tuple[str, ...]
    plain: tuple[str, ...]  # added tokens that are not special (Qwen3's think and tool tags)
    config: dict
    assistant_block: str  # a regex over the rendered text: group 1 is what the model writes
    conversations: list
    variables: dict = field(default_factory=dict)
    bos_in_front: str | None = None  # the post-processor's BOS, as Llama 3's tokenizer.json has it


QWEN3 = Family(
    model_name="qwen3",
    end_of_turn="<|im_end|>",
    template="Qwen-Qwen3-0.6B.jinja",
    special=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    plain=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"),
    config={"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    assistant_block=r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)",
    variables={"enable_thinking": True},
    conversations=[
        {
            "tools": [WEATHER],
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": "",
                    "reasoning_content": "I should call the weather tool.",
                    "tool_calls": _call("Paris"),
                },
                {"role": "tool", "content": "temp=18C sky=sunny", "name": "get_weather"},
                {
                    "role": "assistant",
                    "content": "It is 18 C and sunny.",
                    "reasoning_content": "The tool answered.",
                },
                {"role": "user", "content": "And in Rome?"},  # earlier answers now lose their reasoning
                {
                    "role": "assistant",
                    "content": "",
                    "reasoning_content": "Call it again for Rome.",
                    "tool_calls": _call("Rome"),
                },
                {"role": "tool", "content": "temp=25C sky=clear", "name": "get_weather"},
                {
                    "role": "assistant",
                    "content": "Rome: 25 C, clear.",
                    "reasoning_content": "Answer briefly.",
                },
            ],
        },
        {
            "messages": [
                {"role": "user", "content": "Say hi."},
                {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\nHi!"},  # reasoning inline
                {"role": "user", "content": "Again?"},
                {"role": "assistant", "content": "Hi again!", "reasoning_content": "Repeat."},
            ]
        },
    ],
)

LLAMA31 = Family(
    model_name="llama3",
    end_of_turn="<|eot_id|>",
    template="meta-llama-Llama-3.1-8B-Instruct.jinja",
    special=(
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
    ),
    plain=(),
    config={"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    assistant_block=r"<\|start_header_id\|>assistant<\|end_header_id\|>\n\n(.*?<\|e[om]t_id\|>)",
    variables={"date_string": "02 Mar 2026"},
    bos_in_front="<|begin_of_text|>",
    conversations=[
        {
            "tools": [WEATHER],
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "tool_calls": _call("Paris")},
                {"role": "tool", "content": "temp=18C sky=sunny"},
                {"role": "assistant", "content": "It is 18 C and sunny."},
                {"role": "user", "content": "Thanks."},
                {"role": "assistant", "content": "You are welcome."},
            ],
        },
        {
            "messages": [
                {"role": "user", "content": "Say hi."},
                {"role": "assistant", "content": "Hi!"},
            ]
        },
    ],
)

GPT_OSS = Family(
    model_name="gpt_oss",
    end_of_turn="<|return|>",
    template="openai-gpt-oss-120b.jinja",
    special=(
        "<|startoftext|>",
        "<|endoftext|>",
        "<|start|>",
        "<|end|>",
        "<|message|>",
        "<|channel|>",
        "<|constrain|>",
        "<|return|>",
        "<|call|>",
    ),
    plain=(),
    config={"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>"},
    # one message; messages the model writes back to back (reasoning, a call, an answer) are one block
    assistant_block=r"<\|start\|>assistant(.*?<\|(?:end|return|call)\|>)",
    variables={"reasoning_effort": "high"},
    conversations=[
        {
            "tools": [WEATHER],
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Say hi."},
                {"role": "assistant", "content": "Hi!", "thinking": "Easy."},  # earlier: reasoning dropped
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": "",
                    "thinking": "I should call the weather tool.",
                    "tool_calls": _call("Paris"),
                },
                {"role": "tool", "content": "temp=18C sky=sunny"},
                {"role": "assistant", "content": "It is 18 C and sunny.", "thinking": "The tool answered."},
            ],
        },
    ],
)

FAMILIES = {"qwen3": QWEN3, "llama3.1": LLAMA31, "gpt-oss": GPT_OSS}


def _corpus(family: Family) -> list[str]:
    return [json.dumps(c) for c in family.conversations] + [json.dumps(WEATHER, indent=4)] * 2


def _write_folder(folder: Path, family: Family) -> Path:
    """tokenizer.json (tiny byte-level BPE, the family's added tokens) and tokenizer_config.json with the
    published template in `chat_template`, as the Hub lays them out."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 32, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(_corpus(family), trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in family.special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.plain])
    if family.bos_in_front:
        bos = family.bos_in_front
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    assert tok.get_vocab_size() <= VOCAB
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        **family.config,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "chat_template": (TEMPLATES / family.template).read_text(),
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return folder


def _reference(theirs, family: Family, conversation: dict) -> tuple[list[int], list[bool]]:
    """transformers' ids of the whole conversation, and the tokens holding its assistant blocks."""
    kwargs = {"tools": conversation.get("tools"), **family.variables}
    text = theirs.apply_chat_template(conversation["messages"], tokenize=False, **kwargs)
    ids = theirs.apply_chat_template(conversation["messages"], tokenize=True, return_dict=True, **kwargs)
    encoding = theirs(text, add_special_tokens=False)
    assert encoding["input_ids"] == list(ids["input_ids"])
    spans: list[list[int]] = []
    for m in re.finditer(family.assistant_block, text, flags=re.DOTALL):
        if spans and spans[-1][1] == m.start():  # written back to back: one block
            spans[-1][1] = m.end(1)
        else:
            spans.append([m.start(1), m.end(1)])
    assert spans
    trained = [False] * len(encoding["input_ids"])
    for start, end in spans:
        first, last = encoding.char_to_token(start), encoding.char_to_token(end - 1)
        for i in range(first, last + 1):
            trained[i] = True
    return encoding["input_ids"], trained


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_folder(request, tmp_path_factory):
    family = FAMILIES[request.param]
    folder = _write_folder(tmp_path_factory.mktemp(request.param), family)
    return family, folder, AutoTokenizer.from_pretrained(folder)


def test_assistant_masks_equal_the_blocks_of_transformers_render_of_the_whole_conversation(family_folder):
    family, folder, theirs = family_folder
    tokenizer = build_tokenizer(folder)
    assert (tokenizer.bos_id is None) is (family.config["bos_token"] is None)
    template = load_chat_template(folder, variables=family.variables)
    for conversation in family.conversations:
        ids, trained = _reference(theirs, family, conversation)
        ours = tokenize_conversation(
            conversation["messages"],
            template,
            tokenizer,
            "assistant",
            "test",
            tools=conversation.get("tools"),
        )
        assert ours.tokens.tolist() == ids
        assert ours.trained.tolist() == trained
        # the last answer's reasoning and the tool calls are trained; tool replies and prompts are not
        text = tokenizer.decode([t for t, on in zip(ids, trained, strict=True) if on])
        last = conversation["messages"][-1]
        assert (last.get("reasoning_content") or last.get("thinking") or "") in text
        assert ("get_weather" in text) is ("tools" in conversation)
        assert "temp=18C" not in text and "Weather in Paris?" not in text
    assert end_of_turn_id(template, tokenizer) == theirs.convert_tokens_to_ids(family.end_of_turn)


def _hf_model(family: Family, theirs) -> torch.nn.Module:
    """A 2-layer model of the family with random weights (norms around 1, gpt-oss's sinks too)."""
    eos = theirs.convert_tokens_to_ids(family.config["eos_token"])
    shape = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        eos_token_id=eos,
    )
    if family.model_name == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**shape, rope_theta=10000.0))
    elif family.model_name == "llama3":
        model = LlamaForCausalLM(LlamaConfig(**shape, rope_theta=10000.0))
    else:  # gpt-oss's own settings at this size: experts, a sliding window on even layers, YaRN
        rope = {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 8.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        }
        rope |= {"truncate": False, "original_max_position_embeddings": 256}
        shape |= dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=8)
        model = GptOssForCausalLM(GptOssConfig(**shape, rope_parameters=rope))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.is_floating_point() and "inv_freq" not in name:
                t.copy_(
                    torch.randn(t.shape, generator=g) * (0.5 if name.endswith("sinks") else 0.1)
                    + ("norm" in name)
                )
    return model.eval()


def _expected_loss(model, references: list[tuple[list[int], list[bool]]]) -> float:
    """transformers' loss over the trained tokens of every conversation (the next token's label)."""
    total, count = 0.0, 0
    for ids, trained in references:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].double()
        losses = F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")
        mask = torch.tensor(trained[1:])
        total += losses[mask].sum().item()
        count += int(mask.sum())
    return total / count


def test_step_one_loss_equals_transformers_masked_loss_on_the_same_model(family_folder, tmp_path, one_rank):
    family, folder, theirs = family_folder
    model = _hf_model(family, theirs)
    model.save_pretrained(folder)
    references = [_reference(theirs, family, c) for c in family.conversations]
    seq_len = 64 * (max(len(ids) for ids, _ in references) // 64 + 1)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in family.conversations))
    flags = (
        "--job.dump_folder", str(tmp_path / "out"),
        "--model.name", family.model_name,
        "--model.flavor", "from_hf",
        "--model.hf_assets_path", str(folder),
        "--checkpoint.enable",
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.initial_load_path", str(folder),
        "--checkpoint.interval", "1000",
        "--training.dataset", "chat",
        "--training.dataset_path", str(data),
        "--training.seq_len", str(seq_len),
        "--training.local_batch_size", str(len(references)),
        "--training.steps", "1",
        "--sft.packing", "false",
        "--sft.template_variables", json.dumps(family.variables),
        "--activation_checkpoint.mode", "none",
        "--metrics.log_freq", "1",
        "--lr_scheduler.warmup_steps", "0",
    )  # fmt: skip
    trainer = Trainer(resolve(load_job_config(list(flags)), 1, "cpu"), one_rank)
    (loss,) = trainer.train()
    assert loss == pytest.approx(_expected_loss(model, references), abs=1e-5)


@pytest.mark.parametrize("thinking", [True, False])
def test_qwen3_without_thinking_trains_the_answer_after_the_empty_think_block_its_prompt_holds(
    tmp_path, thinking
):
    """With `enable_thinking = false` Qwen3's generation prompt ends with an empty think block, so the
    model never writes it: the last answer trains from after it. With thinking on, the model writes it."""
    folder = _write_folder(tmp_path, QWEN3)
    tokenizer = build_tokenizer(folder)
    template = load_chat_template(folder, variables={"enable_thinking": thinking})
    messages = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}]
    ours = tokenize_conversation(messages, template, tokenizer, "last", "test")
    trained = tokenizer.decode(ours.tokens[ours.trained].tolist())
    assert trained == ("<think>\n\n</think>\n\n" if thinking else "") + "Hi!<|im_end|>"


def test_grpo_prompts_from_plain_text_render_as_transformers_renders_the_system_and_user_turns(
    family_folder, tmp_path
):
    """GSM8K-style `question` text framed as a user turn after a system prompt (`grpo.text_prompts =
    "user_turn"`) gives, under each published template (Qwen3's BOS-less ChatML with its think-block rules,
    Llama 3.1's, gpt-oss's harmony), the ids transformers' apply_chat_template gives that conversation with
    its generation prompt: no BOS where the tokenizer has none, none doubled where it has one. Planted once:
    framing the text without the system turn failed every family."""
    family, folder, theirs = family_folder
    questions = ["What is 7 plus 5?", "Natalia sold 48 clips in April; how many in May?"]
    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": "#### 12"}) + "\n" for q in questions))
    system = "Reason step by step, then give the answer after ####."
    tokenizer = build_tokenizer(folder)
    template = load_chat_template(folder, variables=family.variables)
    fields = PromptFields("question", text_as_turn=True, system=system)
    prompts = load_prompts(data, template, tokenizer, 512, fields=fields)
    expected = [
        list(
            theirs.apply_chat_template(
                [{"role": "system", "content": system}, {"role": "user", "content": q}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
                **family.variables,
            )["input_ids"]
        )
        for q in questions
    ]
    assert [p.ids.tolist() for p in prompts] == expected
    if tokenizer.bos_id is None:
        assert all(theirs.bos_token_id not in ids for ids in expected)
    assert [p.columns for p in prompts] == [{"answer": "#### 12"}] * 2
