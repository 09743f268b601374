import pytest

from titan_data import DataError, build_tokenizer
from titan_data.datasets.sources import ASSETS
from titan_data.tokenizers.tiktoken_bpe import save_tiktoken_ranks

TOKENIZER = ASSETS / "tokenizer"


def test_bundled_llama3_format_tokenizer_round_trips_text():
    tok = build_tokenizer(TOKENIZER)
    text = "Return the number of items in a container.\n  Raise ValueError if empty!"
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids[1:-1]) == text


def test_special_tokens_follow_the_bpe_ranks_and_fill_the_vocabulary():
    tok = build_tokenizer(TOKENIZER / "tokenizer.model")
    assert tok.vocab_size == 2048
    assert (tok.bos_id, tok.eos_id) == (1792, 1793)
    assert tok.special_tokens["<|eot_id|>"] == 1792 + 9


def test_special_token_text_inside_documents_is_plain_text():
    tok = build_tokenizer(TOKENIZER)
    ids = tok.encode("<|end_of_text|>")
    assert tok.eos_id not in ids
    assert tok.decode(ids) == "<|end_of_text|>"


def test_folder_without_tokenizer_names_folder_and_files(tmp_path):
    with pytest.raises(DataError, match=rf"no tokenizer in folder {tmp_path}; looked for tokenizer.model"):
        build_tokenizer(tmp_path)


def test_corrupt_tokenizer_file_is_refused_with_the_line(tmp_path):
    bad = tmp_path / "tokenizer.model"
    save_tiktoken_ranks({b"a": 0, b"b": 1}, bad)
    bad.write_text(bad.read_text() + "not-base64!! x\n")
    with pytest.raises(DataError, match="line 3"):
        build_tokenizer(bad)
