import json
import shutil

import numpy as np
import pytest

from titan_data import DataError, build_tokenizer
from titan_data.datasets.registry import ASSETS
from titan_data.tokenizers.hf_json import HuggingFaceTokenizer
from titan_data.tokenizers.sentencepiece_bpe import SentencePieceTokenizer
from titan_data.tokenizers.tiktoken_bpe import TikTokenTokenizer, save_tiktoken_ranks

LLAMA3 = ASSETS / "tokenizer"
LLAMA2 = ASSETS / "tokenizer_llama2"
TEXT = "Return the number of items in a container.\n  Raise ValueError if empty! 12345 wörld"


@pytest.mark.parametrize(
    "path", [LLAMA3, LLAMA3 / "tokenizer.json", LLAMA2], ids=["llama3", "tokenizer.json", "llama2"]
)
def test_every_format_round_trips_text_framed_by_its_own_bos_and_eos(path):
    tok = build_tokenizer(path)
    ids = tok.encode(TEXT, bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.bos_id not in ids[1:-1] and tok.eos_id not in ids[1:-1]
    assert tok.decode(ids[1:-1]) == TEXT
    assert max(ids) < tok.vocab_size


@pytest.mark.parametrize(
    "path", [LLAMA3, LLAMA3 / "tokenizer.json", LLAMA2], ids=["llama3", "tokenizer.json", "llama2"]
)
def test_encode_array_gives_the_ids_of_encode(path, corpus):
    tok = build_tokenizer(path)
    for text in [*corpus[:50], "<|end_of_text|> and <s>", ""]:
        for bos, eos in ((False, False), (True, True), (True, False)):
            array = tok.encode_array(text, bos=bos, eos=eos)
            assert array.dtype == np.uint32 and array.tolist() == tok.encode(text, bos=bos, eos=eos)


def test_llama3_special_tokens_follow_the_bpe_ranks_and_fill_the_vocabulary():
    tok = build_tokenizer(LLAMA3 / "tokenizer.model")
    assert isinstance(tok, TikTokenTokenizer)
    assert tok.vocab_size == 2048
    assert (tok.bos_id, tok.eos_id) == (1792, 1793)
    assert tok.special_tokens["<|eot_id|>"] == 1792 + 9


def test_llama2_sentencepiece_model_is_recognised_and_reads_bos_eos_from_the_file():
    tok = build_tokenizer(LLAMA2)
    assert isinstance(tok, SentencePieceTokenizer)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (2048, 1, 2)
    # byte fallback: characters never seen in training still round-trip
    assert tok.decode(tok.encode("☃ 漢字")) == "☃ 漢字"


def test_tokenizer_json_gives_the_same_ids_as_the_tiktoken_file_of_the_same_folder(llama3_tokenizer, corpus):
    hf = build_tokenizer(LLAMA3 / "tokenizer.json")
    assert isinstance(hf, HuggingFaceTokenizer)
    assert (hf.vocab_size, hf.bos_id, hf.eos_id) == (2048, 1792, 1793)
    for text in corpus[:300]:
        assert hf.encode(text, bos=True, eos=True) == llama3_tokenizer.encode(text, bos=True, eos=True)


def test_special_ids_are_the_control_tokens_of_each_format(llama3_tokenizer):
    reserved = set(range(1792, 2048))  # Llama 3's 256 special tokens follow the 1,792 BPE ranks here
    assert llama3_tokenizer.special_ids == reserved
    assert build_tokenizer(LLAMA3 / "tokenizer.json").special_ids == reserved
    llama2 = build_tokenizer(LLAMA2)
    assert {llama2.bos_id, llama2.eos_id} <= llama2.special_ids and len(llama2.special_ids) == 3  # and <unk>


@pytest.mark.parametrize(
    "path", [LLAMA3, LLAMA3 / "tokenizer.json", LLAMA2], ids=["llama3", "tokenizer.json", "llama2"]
)
def test_special_token_text_inside_documents_is_plain_text(path):
    tok = build_tokenizer(path)
    for text in ("<|end_of_text|>", "<|begin_of_text|>", "<s>", "</s>"):
        ids = tok.encode(text)
        assert tok.bos_id not in ids and tok.eos_id not in ids
        assert tok.decode(ids) == text


def test_folder_with_only_tokenizer_json_uses_it_with_ids_from_tokenizer_config(tmp_path):
    shutil.copy(LLAMA3 / "tokenizer.json", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": {"content": "<|eot_id|>"}, "eos_token": "<|eom_id|>"})
    )
    tok = build_tokenizer(tmp_path)
    assert isinstance(tok, HuggingFaceTokenizer)
    assert (tok.bos_id, tok.eos_id) == (1792 + 9, 1792 + 8)


def test_bos_eos_ids_can_come_from_generation_config(tmp_path):
    shutil.copy(LLAMA3 / "tokenizer.json", tmp_path)
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1792, "eos_token_id": [1801, 1793]})
    )
    assert (build_tokenizer(tmp_path).bos_id, build_tokenizer(tmp_path).eos_id) == (1792, 1801)


def test_hub_llama3_layout_prefers_original_tokenizer_model(tmp_path):
    shutil.copy(LLAMA3 / "tokenizer.json", tmp_path)
    (tmp_path / "original").mkdir()
    shutil.copy(LLAMA3 / "tokenizer.model", tmp_path / "original")
    assert isinstance(build_tokenizer(tmp_path), TikTokenTokenizer)


def test_tokenizer_json_without_eos_names_the_files_it_looked_in(tmp_path):
    shutil.copy(LLAMA3 / "tokenizer.json", tmp_path)
    with pytest.raises(
        DataError, match=r"no EOS token declared .*tokenizer_config.json, special_tokens_map.json"
    ):
        build_tokenizer(tmp_path)


def _tokenizer_folder(folder, post_processor: bool, **config) -> None:
    """The bundled tokenizer.json, its post-processor (which puts BOS in front, as Llama 3's) kept or
    removed (as Qwen's, which adds nothing), with `config` as its tokenizer_config.json."""
    data = json.loads((LLAMA3 / "tokenizer.json").read_text())
    if not post_processor:
        data["post_processor"] = None
    (folder / "tokenizer.json").write_text(json.dumps(data))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


END = "<|end_of_text|>"


@pytest.mark.parametrize(
    "post_processor, config, adds_bos",
    [
        (False, {"bos_token": None, "eos_token": END}, False),  # Qwen2.5/Qwen3 as published
        (False, {"bos_token": "<|begin_of_text|>", "eos_token": END}, False),  # gpt-oss: declared, not added
        (True, {"bos_token": "<|begin_of_text|>", "eos_token": END}, True),  # Llama 3: the file adds it
    ],
    ids=["bos-null", "declared-not-added", "post-processor"],
)
def test_bos_is_optional_and_added_as_transformers_adds_it(tmp_path, post_processor, config, adds_bos):
    transformers = pytest.importorskip("transformers")
    _tokenizer_folder(tmp_path, post_processor, **config)
    tok = build_tokenizer(tmp_path)
    assert tok.add_bos is adds_bos and tok.bos_id == (None if config["bos_token"] is None else 1792)
    ids = tok.encode(TEXT, bos=True, eos=True)
    assert ids[-1] == tok.eos_id and (ids[0] == 1792) is adds_bos
    assert tok.encode_array(TEXT, bos=True, eos=True).tolist() == ids
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    # transformers frames a text with what its special tokens add: BOS here exactly when Titan adds it
    assert theirs(TEXT)["input_ids"] == ids[:-1]
    assert tok.special_ids == set(range(1792, 2048))


@pytest.mark.parametrize("written", [True, False])
def test_add_bos_token_in_the_config_decides_over_the_file(tmp_path, written):
    # torchtitan's rule: a tokenizer_config.json that says add_bos_token is obeyed (DeepSeek-V3 says true)
    _tokenizer_folder(
        tmp_path, not written, bos_token="<|begin_of_text|>", eos_token=END, add_bos_token=written
    )
    tok = build_tokenizer(tmp_path)
    assert tok.add_bos is written and (tok.encode(TEXT, bos=True)[0] == 1792) is written


def test_config_naming_a_token_the_vocabulary_lacks_is_refused(tmp_path):
    shutil.copy(LLAMA3 / "tokenizer.json", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    with pytest.raises(DataError, match="names bos_token '<s>', which .*tokenizer.json does not hold"):
        build_tokenizer(tmp_path)


def test_folder_without_tokenizer_names_folder_and_files(tmp_path):
    with pytest.raises(
        DataError,
        match=rf"no tokenizer in folder {tmp_path}; looked for tokenizer.model, original/tokenizer.model, tokenizer.json",
    ):
        build_tokenizer(tmp_path)


def test_corrupt_tiktoken_file_is_refused_with_the_line(tmp_path):
    bad = tmp_path / "tokenizer.model"
    save_tiktoken_ranks({b"a": 0, b"b": 1}, bad)
    bad.write_text(bad.read_text() + "not-base64!! x\n")
    with pytest.raises(DataError, match="line 3"):
        build_tokenizer(bad)


@pytest.mark.parametrize(
    "name,content", [("tokenizer.model", b"\x00\x01 not a model"), ("tokenizer.json", b"{]")]
)
def test_unreadable_tokenizer_file_is_a_clear_error(tmp_path, name, content):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(DataError, match=rf"tokenizer: {tmp_path / name} is"):
        build_tokenizer(tmp_path)
