"""Chat rows from local files or a Hugging Face dataset, as lists of messages.

Three row layouts are understood: OpenAI-style `messages` (role/content turns), prompt/completion
pairs and alpaca (instruction/input/output). Each becomes a list of turns with a `role` and a
`content`, so the template and the masks see one shape whatever the file held. A `messages` turn
reaches the template with every field it has, as transformers passes it (`reasoning_content` for
Qwen3, `thinking` for gpt-oss, `tool_calls`, `name`, `tool_call_id`, ...), and a row's `tools` list
goes to the template beside the messages. An assistant turn that calls tools may have no content
(OpenAI's `null`). A bad row is reported in one line naming the file, the row and the field.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titan_data.datasets.hf_datasets import is_dataset_repository, is_saved_dataset, load_rows
from titan_data.errors import DataError

ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")
TOOLS_FIELD = "tools"
ROW_FORMATS = ("auto", "messages", "prompt_completion", "alpaca")
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass(frozen=True)
class RowFields:
    """Which fields of a row hold the conversation, and which layout to expect ("auto": by the fields)."""

    format: str = "auto"
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    completion_field: str = "completion"


@dataclass(frozen=True)
class ChatRow:
    """One conversation and where it came from (for error messages)."""

    messages: list[dict[str, Any]]
    where: str
    tools: list[Any] | None = None


def _check_message(turn: Any, where: str, field: str) -> dict[str, Any]:
    """The turn itself, every field kept (the template decides what it renders), once its role,
    content and tool calls have the shapes templates read."""
    if not isinstance(turn, dict):
        raise DataError(
            f"dataset: {where}: '{field}' holds a {type(turn).__name__}, not a {{role, content}} turn"
        )
    role, content, calls = turn.get("role"), turn.get("content"), turn.get("tool_calls")
    if role not in ROLES:
        raise DataError(f"dataset: {where}: '{field}' has role {role!r}; roles are {', '.join(ROLES)}")
    if calls is not None and not (
        role == "assistant" and isinstance(calls, list) and all(isinstance(c, dict) for c in calls)
    ):
        raise DataError(
            f"dataset: {where}: '{field}' {role} turn has tool_calls that are not an assistant's list of "
            "{function: {name, arguments}} objects"
        )
    if not isinstance(content, str) and not (content is None and calls):
        raise DataError(
            f"dataset: {where}: '{field}' {role} turn content is {type(content).__name__}, not a string"
        )
    return dict(turn)


def _row_tools(row: dict, where: str) -> list[Any] | None:
    tools = row.get(TOOLS_FIELD)
    if tools is None:
        return None
    if isinstance(tools, str):  # datasets often keep the schemas as one JSON string
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            raise DataError(f"dataset: {where}: '{TOOLS_FIELD}' is a string but not JSON") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise DataError(f"dataset: {where}: '{TOOLS_FIELD}' must be a list of tool schemas (objects)")
    return tools


def _text(row: dict, field: str, where: str, *, required: bool = True) -> str:
    if field not in row or row[field] is None:
        if not required:
            return ""
        raise DataError(f"dataset: {where}: no '{field}' field (fields: {', '.join(map(str, row))})")
    if not isinstance(row[field], str):
        raise DataError(f"dataset: {where}: '{field}' is {type(row[field]).__name__}, not a string")
    return row[field]


def _layout(row: dict, fields: RowFields) -> str:
    if fields.format != "auto":
        return fields.format
    if fields.messages_field in row:
        return "messages"
    if fields.prompt_field in row or fields.completion_field in row:
        return "prompt_completion"
    if "instruction" in row or "output" in row:
        return "alpaca"
    return "messages"  # reported as a missing messages field


def row_to_messages(row: Any, fields: RowFields, where: str) -> list[dict[str, Any]]:
    """The turns of one row in any of the three layouts; DataError naming `where` and the field."""
    if not isinstance(row, dict):
        raise DataError(f"dataset: {where} is a {type(row).__name__}, not an object with fields")
    layout = _layout(row, fields)
    if layout == "messages":
        field = fields.messages_field
        turns = row.get(field)
        if turns is None:
            raise DataError(f"dataset: {where}: no '{field}' field (fields: {', '.join(map(str, row))})")
        if not isinstance(turns, list) or not turns:
            raise DataError(f"dataset: {where}: '{field}' must be a non-empty list of turns")
        return [_check_message(turn, where, field) for turn in turns]
    if layout == "prompt_completion":
        prompt = _text(row, fields.prompt_field, where)
        completion = _text(row, fields.completion_field, where)
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
    instruction = _text(row, "instruction", where)
    extra = _text(row, "input", where, required=False)
    output = _text(row, "output", where)
    prompt = f"{instruction}\n\n{extra}" if extra else instruction
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}]


def _json_rows(path: Path) -> Iterator[tuple[Any, str]]:
    text = path.read_text(encoding="utf-8-sig")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataError(f"dataset: {path} is not valid JSON ({err})") from None
        for i, row in enumerate(rows):
            yield row, f"{path} row {i}"
        return
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield json.loads(line), f"{path} line {number}"
        except json.JSONDecodeError as err:
            yield DataError(f"dataset: {path} line {number} is not a JSON object ({err.msg})"), ""


def _parquet_rows(path: Path) -> Iterator[tuple[Any, str]]:
    import pyarrow.parquet as pq  # only parquet users pay for it

    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises its own types for unreadable files
        raise DataError(f"dataset: {path} is not a readable parquet file: {err}") from err
    for i, row in enumerate(table.to_pylist()):
        yield row, f"{path} row {i}"


def chat_files(path: str | Path) -> list[Path]:
    """The chat files at `path`: the file itself, or every .jsonl/.json/.parquet under the folder."""
    path = Path(path)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in FILE_SUFFIXES)
        if files:
            return files
        raise DataError(f"dataset: {path} holds no {', '.join(FILE_SUFFIXES)} files")
    raise DataError(f"dataset: chat data at {path} does not exist; set dataset_path to a file or folder")


def _local_rows(path: str | Path) -> Iterator[tuple[Any, str]]:
    """Every row of the plain local files at `path` (a .jsonl/.json/.parquet file or a folder of them) as
    (row, where), in order; a row that cannot be read comes as the DataError that names it."""
    for f in chat_files(path):
        yield from (_parquet_rows if f.suffix == ".parquet" else _json_rows)(f)


def rows_at(path: str | Path, split: str = "", config: str = "") -> Iterator[tuple[Any, str]]:
    """Every row at `path` as (row, where), in order: plain local files read here; a hub id, a
    `save_to_disk` folder or a copy of a Hub dataset repository through `datasets` (`hf_datasets.load_rows`:
    its `split`, train by default, of its `config`). Chat rows, preference pairs and prompts all read their
    sources here."""
    local = Path(path).exists() or Path(path).suffix in FILE_SUFFIXES
    if local and not (split or config or is_saved_dataset(path) or is_dataset_repository(path)):
        yield from _local_rows(path)
        return
    named = [f"split {split}"] * bool(split) + [f"configuration {config}"] * bool(config)
    where = f"{path} ({', '.join(named)})" if named else str(path)
    for i, row in enumerate(load_rows(path, split, config)):
        yield row, f"{where} row {i}"


def read_chat_rows(
    path: str | Path, fields: RowFields, split: str = "", config: str = ""
) -> Iterator[ChatRow | DataError]:
    """Every chat row at `path` (see `rows_at`), in order; a bad row comes as the DataError that names
    it, so the caller decides whether it stops the run."""
    for row, where in rows_at(path, split, config):
        if isinstance(row, DataError):
            yield row
            continue
        try:
            messages = row_to_messages(row, fields, where)
            yield ChatRow(messages, where, _row_tools(row, where))
        except DataError as err:
            yield err
