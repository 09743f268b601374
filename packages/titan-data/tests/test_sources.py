import gzip
import json
from itertools import islice

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from titan_data import DATASETS, DataError, FileSource, IterableSource, get_source, register_dataset


def _write(path, texts, fmt):
    if fmt == "parquet":
        # small row groups, so resuming has whole groups to skip
        pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), path, row_group_size=7)
        return
    lines = [json.dumps({"text": t, "url": "u"}) for t in texts] if fmt.startswith("json") else texts
    data = ("\n\n".join(lines) + "\n").encode()  # blank lines between records are skipped
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)


FORMATS = {"jsonl": "docs.jsonl", "json.gz": "docs.json.gz", "text": "docs.txt", "parquet": "docs.parquet"}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("stop", [0, 1, 13, 29])
def test_reading_on_from_a_saved_position_gives_exactly_the_rest(tmp_path, corpus, fmt, stop):
    texts = [t.replace("\n", " ") for t in corpus[:30]] if fmt == "text" else corpus[:30]
    _write(tmp_path / FORMATS[fmt], texts[:20], fmt)
    _write(tmp_path / ("more_" + FORMATS[fmt]), texts[20:], fmt)
    source = FileSource.from_path("local", tmp_path)
    assert source.num_shards == 2
    reader = source.open()
    head = list(islice(reader, stop))
    tail = list(source.open(reader.position()))
    assert head + tail == texts


def test_a_folder_is_read_recursively_in_name_order_and_other_files_are_ignored(tmp_path):
    (tmp_path / "b").mkdir()
    _write(tmp_path / "b" / "1.jsonl", ["b1"], "jsonl")
    _write(tmp_path / "a.jsonl", ["a"], "jsonl")
    (tmp_path / "notes.md").write_text("not data")
    assert list(get_source("json", tmp_path).read()) == ["a", "b1"]


def test_text_field_can_be_chosen(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"content": "x"}) + "\n")
    assert list(FileSource.from_path("d", tmp_path, text_field="content").read()) == ["x"]


LINES = [
    '{"text":"C4 \\"layout\\"\\u00e9\\n","timestamp":"2019-04-25T12:57:54Z","url":"https://x"}',
    '{"text": "spaced", "url": "u"}',
    '{ "text" : "loose" }',
    '{"url": "u", "text": "text second"}',
    '{"text": "first", "text": "repeated key: the last wins, as in json.loads"}',
    '{"text": "\u00e9 non-ASCII written raw"}',
]


def test_json_lines_give_the_text_json_loads_gives_for_every_layout(tmp_path):
    # C4's layout (text first) is scanned in place; every other layout takes json.loads.
    (tmp_path / "d.jsonl").write_text("\n".join(LINES) + "\n", encoding="utf-8")
    assert list(get_source("json", tmp_path).read()) == [json.loads(line)["text"] for line in LINES]


@pytest.mark.parametrize(
    "line", ['{"text": "unterminated', '{"text": "ok", "url": "cut', '{"text": "tab\there"}', '{"text": 5}']
)
def test_a_json_line_broken_after_its_text_is_still_refused(tmp_path, line):
    (tmp_path / "d.jsonl").write_text(line + "\n")
    with pytest.raises(DataError, match="d.jsonl at byte 0"):
        list(get_source("json", tmp_path).read())


def test_a_broken_json_line_names_the_file_and_byte_offset(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "fine"}\n{"txt": "no text field"}\n')
    with pytest.raises(
        DataError, match=rf"{tmp_path / 'd.jsonl'} at byte 17 is not a JSON object with a 'text' field"
    ):
        list(get_source("json", tmp_path).read())


def test_a_parquet_file_without_the_text_column_lists_its_columns(tmp_path):
    pq.write_table(pa.table({"body": ["x"], "id": [1]}), tmp_path / "d.parquet")
    with pytest.raises(DataError, match="has no 'text' column; its columns are body, id"):
        list(get_source("parquet", tmp_path).read())


def test_local_datasets_need_a_path_that_holds_their_files(tmp_path):
    with pytest.raises(DataError, match="'json' reads local files; set dataset_path"):
        get_source("json")
    with pytest.raises(DataError, match=rf"no .txt, .txt.gz files under {tmp_path}"):
        get_source("text", tmp_path)
    with pytest.raises(DataError, match="expects its files at /nowhere, which does not exist"):
        get_source("c4_test", "/nowhere")


def test_c4_read_from_a_local_copy_laid_out_as_on_the_hub(c4_folder, c4_texts):
    source = get_source("c4", c4_folder)
    assert source.num_shards == 12 and source.equal_shards
    by_file = [c4_texts[f::12] for f in range(12)]
    assert list(source.read()) == [t for texts in by_file for t in texts]
    assert list(source.shard(4, 1).read()) == by_file[1] + by_file[5] + by_file[9]


def test_c4_resumes_from_a_saved_position_past_a_file_end(c4_folder):
    source = get_source("c4", c4_folder).shard(3, 2)
    everything = list(source.read())
    reader = source.open()
    head = list(islice(reader, 27))  # past the end of the first file
    assert head + list(source.open(reader.position())) == everything


def test_c4_validation_reads_the_validation_files(tmp_path, write_c4_layout):
    write_c4_layout(tmp_path, ["v1", "v2", "v3"], 2, split="validation")
    write_c4_layout(tmp_path, ["train"], 1)
    assert list(get_source("c4_validation", tmp_path).read()) == ["v1", "v3", "v2"]


def test_c4_folder_without_hub_files_says_what_it_expected(tmp_path):
    with pytest.raises(
        DataError, match=r"expected .*en/c4-train.00000-of-01024.json.gz and the like\); on a node"
    ):
        get_source("c4", tmp_path)


def test_users_register_their_own_datasets_by_name(tmp_path):
    name = "my_corpus_for_test"
    register_dataset(
        name, lambda path: IterableSource(name, lambda: (f"doc {i} at {path}" for i in range(5))), "test docs"
    )
    try:
        reader = get_source(name, "here").open()
        assert next(reader) == "doc 0 at here"
        assert list(get_source(name, "here").open(reader.position())) == [
            f"doc {i} at here" for i in range(1, 5)
        ]
        with pytest.raises(DataError, match=f"'{name}' is already registered"):
            register_dataset(name, lambda path: None)
    finally:
        del DATASETS[name]


def test_unknown_dataset_names_the_registered_ones():
    with pytest.raises(
        DataError,
        match="unknown dataset 'c5'; registered: c4, c4_test, c4_validation, chat, json, parquet, preference, prompts, text, token_shards",
    ):
        get_source("c5")


def test_token_shards_are_not_text():
    with pytest.raises(DataError, match="'token_shards' holds tokens, not text; build it with build_dataset"):
        get_source("token_shards", "/x")
