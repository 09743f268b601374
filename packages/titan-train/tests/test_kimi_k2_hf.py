"""A Kimi K2 folder as Moonshot publishes it, in miniature, through the deepseek_v3 family: import, train,
export, generate.

The folder is built here (nothing downloaded): transformers saves a tiny random `DeepseekV3ForCausalLM`
(query latent, one dense block, sigmoid routing scaled by 2.827 with the score-correction bias, one shared
expert, YaRN with beta_fast = beta_slow = 1 and rope theta 50000, as Kimi K2's config.json), its config.json
rewritten to Kimi's `model_type` "kimi_k2" and `auto_map`; beside it a tiktoken rank file `tiktoken.model` and a
`tokenizer_config.json` in Kimi's layout (special tokens at Kimi's offsets after the ranks in
`added_tokens_decoder`, `[BOS]`/`[EOS]`, `auto_map` to `tokenization_kimi`, a chat template in Kimi's style).

The tokenizer is checked against Kimi's algorithm written out here: the published pre-tokenisation regex run
by the `regex` module (set intersection in its V1 syntax), then byte-pair merges by lowest rank. A merge
across the boundary between Latin and Han letters ("o" + the first byte of a Han character) tells Kimi's
pattern from Llama 3's. Planted once each, and each failed these tests: Llama 3's pattern in Kimi's tokenizer
("Hello世界" merged across the boundary); the routing scale 2.827 read as 1 (other greedy tokens from the
first); YaRN's beta_fast taken as DeepSeek's 32 instead of Kimi's 1 (tokens differ from the tenth); rope
theta 10000 instead of 50000 (logits 0.099 off).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import regex
import torch
from safetensors.torch import load_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from titan_data import load_chat_template
from titan_data.tokenizers.build import build_tokenizer
from titan_models import SamplingParams, generate
from titan_train.cli import run
from titan_train.commands.checkpoint_model import load_checkpoint_model
from titan_train.config import load_job_config

# Kimi K2's special tokens by offset after the BPE ranks (163584 in the published tokenizer).
KIMI_SPECIALS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "[EOT]",
    10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>",
    17: "<|im_middle|>",
    254: "[UNK]",
    255: "[PAD]",
}
# Kimi's pre-tokenisation regex as published, in the `regex` module's V1 syntax (which reads `&&` inside a
# set as intersection, as tiktoken's engine does).
REFERENCE_PATTERN = "(?V1)" + "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
# A template in the style of Kimi K2's: role markers, <|im_middle|>, <|im_end|> after each turn.
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif m['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- elif m['role'] == 'tool' -%}<|im_system|>tool<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    "{{ m['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)
# Multi-byte tokens after the 256 single bytes: the boundary-crossing merge first, then common English.
MERGES = ["o" + "世".encode()[:1].decode("latin-1")] + [
    *("th", "he", "in", "er", "an", " t", " a", "re", "on", "at", "en", "nd", "es", "or", " s", " w"),
    *("the", " the", "ing", " and", " of", " to", "ed", "is", " i", "it", "ou", "le", "ar", "al", " c", "st"),
    *(
        "'s",
        "ll",
        " b",
        " f",
        " m",
        " p",
        " d",
        " h",
        "ion",
        "ent",
        " in",
        " is",
        "12",
        "123",
        "世界",
        "你好",
    ),
]
TEXTS = [
    "Hello世界, it's 12345 apples!\n\n  The theatre DON'T stop\tnow 你好吗?",
    "Théâtre and the ring: 7 of 10 were reading it.  \n",
]
PROMPTS = ["The theatre", "it is in the"]
NEW_TOKENS = 12


def _ranks() -> dict[bytes, int]:
    tokens = [bytes([b]) for b in range(256)]
    tokens += [m.encode("latin-1") if m == MERGES[0] else m.encode() for m in MERGES]
    return {t: i for i, t in enumerate(tokens)}


def reference_encode(text: str, ranks: dict[bytes, int]) -> list[int]:
    """Kimi's encoding of plain text: its regex's pieces, each one token where the ranks hold it whole (as
    tiktoken looks it up first), else merged pair by pair, lowest rank first."""
    ids = []
    for piece in regex.findall(REFERENCE_PATTERN, text):
        if piece.encode() in ranks:
            ids.append(ranks[piece.encode()])
            continue
        parts = [bytes([b]) for b in piece.encode()]
        while True:
            pairs = [
                (ranks[a + b], i)
                for i, (a, b) in enumerate(zip(parts, parts[1:], strict=False))
                if a + b in ranks
            ]
            if not pairs:
                break
            _, i = min(pairs)
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        ids += [ranks[p] for p in parts]
    return ids


def _randomise(model: torch.nn.Module) -> None:
    """Every floating parameter and buffer (the expert score-correction bias too), norms around 1."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.is_floating_point() and "inv_freq" not in name:
                std = 1.0 if "embed" in name else 0.1 if "norm" in name or "bias" in name else 0.3
                t.copy_(torch.randn(t.shape, generator=g) * std + ("norm" in name))


@pytest.fixture(scope="module")
def kimi_folder(tmp_path_factory) -> tuple[Path, DeepseekV3ForCausalLM]:
    """The tiny folder in Kimi's layout, and the transformers model it was saved from (the reference)."""
    folder = tmp_path_factory.mktemp("kimi_k2")
    ranks = _ranks()
    first = len(ranks)
    config = DeepseekV3Config(
        vocab_size=first + 256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.827,
        norm_topk_prob=True,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        rope_theta=50000.0,
        rope_scaling={
            "type": "yarn",
            "factor": 32.0,
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
        },
        bos_token_id=first,
        eos_token_id=first + 1,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config).eval()
    _randomise(model)
    model.save_pretrained(folder)
    written = json.loads((folder / "config.json").read_text())
    written |= {
        "model_type": "kimi_k2",
        "architectures": ["DeepseekV3ForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_deepseek.DeepseekV3Config",
            "AutoModel": "modeling_deepseek.DeepseekV3Model",
            "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
        },
    }
    (folder / "config.json").write_text(json.dumps(written, indent=2))
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in ranks.items()]
    (folder / "tiktoken.model").write_text("\n".join(lines) + "\n")
    added = {
        str(first + offset): {
            "content": text,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for offset, text in KIMI_SPECIALS.items()
    }
    tokenizer_config = {
        "added_tokens_decoder": added,
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1048576,
        "tokenizer_class": "TikTokenTokenizer",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return folder, model


def test_kimi_tokenizer_folder_encodes_as_kimis_regex_and_bpe_with_its_special_tokens(kimi_folder):
    folder, _ = kimi_folder
    ranks = _ranks()
    first = len(ranks)
    tokenizer = build_tokenizer(folder)
    assert tokenizer.vocab_size == first + 256
    assert (tokenizer.bos_id, tokenizer.eos_id) == (first, first + 1)
    assert not tokenizer.add_bos and tokenizer.encode("the", bos=True) == reference_encode("the", ranks)
    for text in TEXTS:
        ids = tokenizer.encode(text, eos=True)
        assert ids == [*reference_encode(text, ranks), first + 1], text
        assert tokenizer.decode(ids[:-1]) == text
    assert first + 2 in tokenizer.special_ids and first + 200 in tokenizer.special_ids  # named and reserved
    # A rendered conversation: the markers become Kimi's ids, the rest Kimi's BPE.
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello世界"}]
    text = load_chat_template(folder).render(messages, add_generation_prompt=True)
    ids = tokenizer.encode_chat(text)
    by_text = {t: first + o for o, t in KIMI_SPECIALS.items()}
    expected = []
    for piece in regex.split("(" + "|".join(regex.escape(t) for t in by_text) + ")", text):
        expected += [by_text[piece]] if piece in by_text else reference_encode(piece, ranks)
    assert ids == expected
    assert ids[0] == first + 10  # <|im_system|>
    assert ids[-1] == first + 17 and ids.count(first + 2) == 2  # <|im_middle|> last, <|im_end|> per turn


def test_a_tokenizer_config_naming_other_custom_code_is_refused_in_one_line(kimi_folder, tmp_path):
    folder, _ = kimi_folder
    (tmp_path / "tiktoken.model").write_bytes((folder / "tiktoken.model").read_bytes())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["tokenization_other.OtherTokenizer", None]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match=r"names custom code 'tokenization_other.OtherTokenizer'"):
        build_tokenizer(tmp_path)


FLAGS = (
    *("--model.name", "deepseek_v3", "--model.flavor", "from_hf"),
    *("--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", "2"),
    *("--activation_checkpoint.mode", "none", "--metrics.log_freq", "1", "--optimizer.lr", "1e-3"),
    *("--lr_scheduler.warmup_steps", "1"),
)


def _greedy(model: DeepseekV3ForCausalLM, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            tokens = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
            )
        out.append(tokens[0, len(prompt) :].tolist())
    return out


def test_kimi_folder_generates_transformers_greedy_text_trains_and_exports_through_deepseek_v3(
    kimi_folder, tmp_path
):
    """Titan's generator on the imported folder continues two prompts as transformers' DeepseekV3ForCausalLM
    does (greedy, 12 tokens; logits within 1e-4); a 2-step run from it trains and exports a folder that transformers loads as
    DeepseekV3ForCausalLM (no custom code), with the run's weights, whose greedy text Titan's generator
    on the run's checkpoint matches; the export carries Kimi's tokenizer files."""
    folder, reference = kimi_folder
    tokenizer = build_tokenizer(folder)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    assets = ("--model.hf_assets_path", str(folder))
    start = (
        "--checkpoint.enable",
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.initial_load_path",
        str(folder),
    )
    config = load_job_config(["--job.dump_folder", str(tmp_path / "gen"), *FLAGS, *assets])
    imported = load_checkpoint_model(config, folder, device="cpu").model
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    expected = _greedy(reference, prompts)
    assert all(len(set(t)) >= 4 for t in expected)  # varied text
    assert generate(imported, prompts, params).tokens == expected
    # Tokens can agree while a small error (a rotary band, a routing scale) moves logits under the margins.
    sequence = torch.tensor([prompts[0] + expected[0]])
    with torch.no_grad():
        difference = (imported(sequence) - reference(sequence).logits).abs().max().item()
    assert difference <= 1e-4

    dump = tmp_path / "run"
    assert run(["--job.dump_folder", str(dump), *FLAGS, *assets, *start, "--checkpoint.last_save_in_hf"]) == 0
    lines = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    export = dump / "checkpoint" / "step-2"
    assert json.loads((export / "config.json").read_text())["model_type"] == "deepseek_v3"
    assert {"tiktoken.model", "tokenizer_config.json"} <= {p.name for p in export.iterdir()}
    exported = DeepseekV3ForCausalLM.from_pretrained(export, attn_implementation="eager").eval()
    trained = {k: v for f in export.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    before = reference.state_dict()
    assert any(not torch.equal(trained[k].float(), before[k]) for k in trained if k in before)  # it trained
    ours = load_checkpoint_model(config, export, device="cpu").model
    assert generate(ours, prompts, params).tokens == _greedy(exported, prompts)
    assert build_tokenizer(export).encode(TEXTS[0]) == tokenizer.encode(TEXTS[0])


def test_chat_sft_on_the_kimi_folder_takes_its_template_and_tokens_step_one_loss_equals_transformers(
    kimi_folder, tmp_path
):
    """Chat SFT from the Kimi folder (its template, its tokenizer, loss on the assistant turns): the first
    step's loss equals transformers' DeepseekV3ForCausalLM on the conversations encoded here (Kimi's regex and
    BPE, the markers as Kimi's ids), the targets each assistant reply and its <|im_end|>, never a user or tool
    turn. Kimi's roles each start with a token of their own: with messages split only where the assistant's
    start token is (Titan's rule before Kimi), the user and tool turns after an answer were trained and the
    loss was 9.26 against 9.19."""
    folder, reference = kimi_folder
    ranks = _ranks()
    first = len(ranks)
    by_text = {t: first + o for o, t in KIMI_SPECIALS.items()}
    conversations = [
        [{"role": "user", "content": "the ring"}, {"role": "assistant", "content": "it is the theatre"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "and 12 of the"},
            {"role": "assistant", "content": "reading 你好"},
            {"role": "tool", "content": "42"},
            {"role": "assistant", "content": "at 42"},
            {"role": "user", "content": "in the"},
            {"role": "assistant", "content": "end"},
        ],
    ]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    header = [by_text["<|im_assistant|>"], *reference_encode("assistant", ranks), by_text["<|im_middle|>"]]
    total, count = 0.0, 0
    for messages in conversations:
        text = load_chat_template(folder).render(messages)
        ids = []
        for piece in regex.split("(" + "|".join(regex.escape(t) for t in by_text) + ")", text):
            ids += [by_text[piece]] if piece in by_text else reference_encode(piece, ranks)
        trained = torch.zeros(len(ids), dtype=torch.bool)
        for i in range(len(ids) - len(header) + 1):
            if ids[i : i + len(header)] == header:
                start = i + len(header)
                trained[start : ids.index(by_text["<|im_end|>"], start) + 1] = True
        with torch.no_grad():
            logits = reference(torch.tensor([ids])).logits[0, :-1].double()
        losses = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")
        total += losses[trained[1:]].sum().item()
        count += int(trained[1:].sum())
        assert len(ids) <= 128  # whole conversations: none cut at seq_len
    dump = tmp_path / "sft"
    flags = [
        *FLAGS,
        "--model.hf_assets_path",
        str(folder),
        "--training.steps",
        "1",
        "--training.seq_len",
        "128",
    ]
    flags += [
        "--checkpoint.enable",
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.initial_load_path",
        str(folder),
    ]
    flags += ["--training.dataset", "chat", "--training.dataset_path", str(data), "--sft.packing", "false"]
    assert run(["--job.dump_folder", str(dump), *flags, "--sft.loss_on", "assistant"]) == 0
    (line,) = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert line["loss"] == pytest.approx(total / count, abs=1e-5)
