"""The debug SFT config as a user runs it, to a model transformers answers with: `titan-train --job.config_file
apps/configs/debug_sft.toml` (a fresh process, the bundled arithmetic conversations, loss on assistant
turns), its last save exported to Hugging Face files, then `titan-train generate --chat` on the export
against transformers' greedy `generate` on `apply_chat_template(..., add_generation_prompt=True)` ids,
stopped at the template's end-of-turn token: the same tokens, the same text.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from titan_train.cli import run
from titan_train.wiring.data import BUNDLED_TOKENIZER

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SFT_CONFIG = REPO / "apps" / "configs" / "debug_sft.toml"
PROMPTS = ["What is two plus three?", "What is four times one?"]
CONVERSATION = [
    {"role": "system", "content": "You are a careful calculator."},
    {"role": "user", "content": "What is one plus one?"},
    {"role": "assistant", "content": "One plus one is 2."},
    {"role": "user", "content": "What is three plus four?"},
]
MAX_NEW = 24
STEPS = 12


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """The debug SFT run's dump folder; its last step folder holds the Hugging Face export."""
    dump = tmp_path_factory.mktemp("debug_sft")
    flags = ["--job.dump_folder", str(dump), "--metrics.log_freq", "1", "--metrics.disable_color_printing"]
    # 12 of the config's 20 steps, for CI's time: the loss is near 1 by then.
    flags += ["--training.steps", str(STEPS)]
    export = ["--checkpoint.enable", "--checkpoint.interval", "1000", "--checkpoint.last_save_in_hf"]
    cmd = [sys.executable, "-m", "titan_train.cli", "--job.config_file", str(SFT_CONFIG), *flags, *export]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return dump


def test_debug_sft_config_lowers_the_loss_on_assistant_tokens(sft_run):
    records = [json.loads(line) for line in (sft_run / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in records}
    assert sorted(losses) == list(range(1, STEPS + 1))
    first, last = (
        sum(losses[s] for s in (1, 2, 3)) / 3,
        sum(losses[s] for s in range(STEPS - 2, STEPS + 1)) / 3,
    )
    assert last < 0.5 * first, losses


def _titan_chat(export, capsys, messages_file) -> list[tuple[str, int, str]]:
    """(finish reason, new tokens, completion) per conversation, from the CLI's own output."""
    prompts = [arg for p in PROMPTS for arg in ("--prompt", p)]
    argv = [
        "generate",
        "--checkpoint",
        str(export),
        "--chat",
        *prompts,
        "--messages-file",
        str(messages_file),
    ]
    argv += ["--max-new-tokens", str(MAX_NEW), "--job.config_file", str(SFT_CONFIG)]
    capsys.readouterr()
    assert run(argv) == 0
    out = capsys.readouterr().out
    blocks = re.split(r"^--- prompt \d+ \((\w+), (\d+) tokens\)\n", out, flags=re.M)[1:]
    last_turns = [*PROMPTS, CONVERSATION[-1]["content"]]
    results = []
    for i, turn in enumerate(last_turns):
        reason, count, body = blocks[3 * i], int(blocks[3 * i + 1]), blocks[3 * i + 2]
        assert body.startswith(turn)
        body = body[len(turn) :]
        results.append((reason, count, body.split("\ngenerated ")[0].removesuffix("\n")))
    return results


def test_generate_chat_on_the_export_equals_transformers_greedy_with_the_chat_template(
    sft_run, tmp_path, capsys
):
    (export,) = [p.parent for p in (sft_run / "checkpoint").glob("step-*/config.json")]
    messages_file = tmp_path / "messages.jsonl"
    messages_file.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    titan = _titan_chat(export, capsys, messages_file)

    model = LlamaForCausalLM.from_pretrained(export, torch_dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(BUNDLED_TOKENIZER)
    end_of_turn = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS] + [CONVERSATION]
    stopped = 0
    for (reason, count, text), messages in zip(titan, conversations, strict=True):
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=False
        )
        with torch.no_grad():
            out = model.generate(
                ids,
                max_new_tokens=MAX_NEW,
                do_sample=False,
                eos_token_id=end_of_turn,
                pad_token_id=end_of_turn,
            )
        new = out[0, ids.shape[1] :].tolist()
        if new and new[-1] == end_of_turn:
            new, stopped = new[:-1], stopped + 1
            assert reason == "eos"
        assert count == len(new) and text == tokenizer.decode(new), (text, tokenizer.decode(new))
    assert stopped >= 2  # the trained model ends its answers with <|eot_id|>, and generation stops there
