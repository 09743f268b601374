"""Weights & Biases logging, offline: the run file holds every logged step's scalars, as TensorBoard does.

wandb (an optional extra of titan-train) writes an offline run to `{dump}/wandb/offline-run-*/run-*.wandb`:
LevelDB-log records (32 KiB blocks; a 7-byte header of checksum, length and type per record piece)
of wandb's own `Record` protobuf, after a 7-byte file header. The test reads that file back with
wandb's protobuf classes and compares the history with `metrics.jsonl`.
"""

import json
import struct
import time
from pathlib import Path

import pytest

from titan_train.plan import resolve
from titan_train.reporting.metrics import TB_TAGS
from titan_train.trainer import Trainer

wandb_internal_pb2 = pytest.importorskip(
    "wandb.proto.wandb_internal_pb2", reason="wandb is the `wandb` extra"
)

BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _records(path: Path) -> list:
    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a wandb run file"
    records, pieces, pos = [], b"", 7
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:  # zero padding to the end of a block
            pos += BLOCK - pos % BLOCK
            continue
        pieces += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            records.append(record)
            pieces = b""
    return records


def _finished_records(path: Path, timeout: float = 60.0) -> list:
    """The run file's records once it holds the run's `exit` record: wandb's service process writes the
    file, and `finish()` can return before the service has written the last records."""
    deadline = time.monotonic() + timeout
    while True:
        records = _records(path)
        if any(r.HasField("exit") for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def test_offline_wandb_run_holds_the_logged_scalars_of_every_step(
    tmp_path, one_rank, small_config, monkeypatch
):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    dump = tmp_path / "run"
    config = small_config(
        dump,
        "--metrics.enable_wandb",
        "--metrics.enable_tensorboard",
        "false",
        "--job.description",
        "wandb offline test",
    )
    Trainer(resolve(config, one_rank.world_size, "cpu"), one_rank).train()

    (run_file,) = (dump / "wandb").glob("offline-run-*/run-*.wandb")
    records = _finished_records(run_file)
    (run,) = [r.run for r in records if r.HasField("run")]
    assert run.display_name == "wandb offline test"
    history = {}
    for r in records:
        if r.HasField("history"):
            items = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item
            }
            history[r.history.step.num] = items
    logged = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert sorted(history) == [r["step"] for r in logged] == [1, 2, 3]
    for record in logged:
        step = history[record["step"]]
        for name in ("loss", "grad_norm", "lr", "tokens_seen"):
            assert step[TB_TAGS[name]] == pytest.approx(record[name], rel=1e-6), name
    assert len({history[s][TB_TAGS["loss"]] for s in history}) == 3  # three different steps
