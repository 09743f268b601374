"""An SFT export is a drop-in for the Hugging Face folder the run started from.

The base is a bf16 Llama saved by transformers with the bundled tokenizer, its chat template in
`chat_template.jinja`, and `eos_token_id: [<|end_of_text|>, <|eot_id|>]` in both `config.json` and
`generation_config.json` (tests/fixtures/hf_instruct.py). A LoRA SFT run from it exports merged weights and
a PEFT folder; transformers loads both as they are: the chat template, the eos list, bf16 weights, and a
greedy `generate` (no eos given: the export's generation_config decides) that stops at `<|eot_id|>` where
`titan-train generate --chat` on the same export stops.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from titan_train.cli import run

REPO = Path(__file__).resolve().parents[1]
CHAT_FILE = (
    REPO / "packages" / "titan-data" / "src" / "titan_data" / "assets" / "chat_test" / "chat_test.jsonl"
)
_spec = importlib.util.spec_from_file_location("hf_instruct", REPO / "tests" / "fixtures" / "hf_instruct.py")
hf_instruct = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf_instruct)
EOS_LIST = [hf_instruct.END_OF_TEXT, hf_instruct.END_OF_TURN]
# The base says <|eot_id|> where it would say token 814 (the 4th reply token of PROMPTS[0]): that reply ends
# after 3 tokens; PROMPTS[1]'s runs to the limit. Both must agree between transformers and Titan.
PROMPTS = ["What is two plus three?", "Say seven garden lamp"]
MAX_NEW = 12


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("drop_in")
    base = hf_instruct.write_instruct_folder(root / "base", eot_like=814)
    dump = root / "run"
    flags = [
        *("--job.dump_folder", str(dump), "--model.name", "llama3", "--model.flavor", "from_hf"),
        *("--model.hf_assets_path", str(base), "--checkpoint.enable", "--checkpoint.initial_load_in_hf"),
        *("--checkpoint.last_save_in_hf", "--training.dataset", "chat", "--training.dataset_path", str(CHAT_FILE)),
        *("--training.seq_len", "64", "--training.local_batch_size", "1", "--training.steps", "1"),
        *("--optimizer.lr", "1e-6", "--lr_scheduler.warmup_steps", "0", "--activation_checkpoint.mode", "none"),
        *("--model.converters", "lora", "--lora.rank", "4", "--lora.target_modules", "all-linear"),
        "--metrics.disable_color_printing",
    ]  # fmt: skip
    assert run(flags) == 0
    return base, dump / "checkpoint" / "step-1"


def test_the_export_keeps_the_chat_template_the_eos_list_and_the_base_dtype(exported):
    base, export = exported
    for name in ("config.json", "generation_config.json"):
        assert json.loads((export / name).read_text())["eos_token_id"] == EOS_LIST, name
    assert (export / "chat_template.jinja").read_text() == (base / "chat_template.jinja").read_text()
    dtypes = set()
    for shard in export.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            dtypes |= {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"BF16"}
    model = AutoModelForCausalLM.from_pretrained(export)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert list(model.generation_config.eos_token_id) == EOS_LIST
    messages = [{"role": "user", "content": PROMPTS[0]}]
    for folder in (export, export / "peft_adapter"):
        ids = AutoTokenizer.from_pretrained(folder).apply_chat_template(messages, add_generation_prompt=True)
        assert ids == AutoTokenizer.from_pretrained(base).apply_chat_template(
            messages, add_generation_prompt=True
        )


def _titan_replies(export: Path, capsys) -> list[tuple[str, list[int]]]:
    argv = ["generate", "--checkpoint", str(export), "--weights", "hf", "--chat"]
    argv += ["--max-new-tokens", str(MAX_NEW), *(a for p in PROMPTS for a in ("--prompt", p))]
    argv += ["--model.name", "llama3", "--model.flavor", "from_hf", "--model.hf_assets_path", str(export)]
    capsys.readouterr()
    assert run(argv) == 0
    out = capsys.readouterr().out
    return [
        (m.group(1), int(m.group(2)))
        for m in re.finditer(r"^--- prompt \d+ \((\w+), (\d+) tokens\)", out, re.M)
    ]


def test_transformers_generate_on_the_export_stops_where_titan_generate_chat_stops(exported, capsys):
    _, export = exported
    titan = _titan_replies(export, capsys)
    tokenizer = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    reasons = []
    for (reason, count), prompt in zip(titan, PROMPTS, strict=True):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=False,
        )
        with torch.no_grad():
            new = model.generate(input_ids=ids, max_new_tokens=MAX_NEW, do_sample=False)[
                0, ids.shape[1] :
            ].tolist()
        stopped = new[-1] in EOS_LIST
        assert (reason == "eos", count) == (stopped, len(new) - stopped), prompt
        reasons.append(reason)
    assert (
        reasons[0] == "eos" and new[-1] != hf_instruct.END_OF_TURN
    )  # one reply ends at <|eot_id|>, one runs on
