"""bench/gpu_recipes.py's GPU runs pass the start checks here, so a GPU lease is not lost to a refused flag.

Each run of every case, at the GPU shapes, is checked as `titan-train check --ngpu 1` checks a launch (every
config field, the model against the layout, the data files the flags name), on the conversations and pairs
the script writes; bench/ is on the path, as the script's `--experimental.custom_import cut_flavors` needs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import gpu_recipes  # noqa: E402

from titan_train.commands.check import check_launch  # noqa: E402
from titan_train.config import load_job_config  # noqa: E402

STEPS = 6


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("recipes")
    gpu_recipes.write_data(folder, gpu_recipes.GPU, rows=50)
    return folder


def _runs(data: Path):
    for case, runs in gpu_recipes.cases(gpu_recipes.GPU, data, STEPS).items():
        for run in runs:
            yield case, run


CASE_RUNS = [f"{case}/{run.name}" for case, run in _runs(Path("."))]


@pytest.mark.parametrize("which", CASE_RUNS)
def test_every_gpu_run_passes_the_start_checks_for_one_gpu(which, data, monkeypatch):
    monkeypatch.chdir(REPO)
    run = dict((f"{case}/{r.name}", r) for case, r in _runs(data))[which]
    config = load_job_config(list(run.flags), check_paths=True)
    check_launch(config, 1)  # raises the one-line refusal a launch would stop at
    shape = gpu_recipes.GPU
    assert config.model.flavor in (shape.dense, shape.cut, shape.moe)
    if run.name in ("packed", "padded"):  # the later flag wins over the config file's
        assert config.sft.packing is (run.name == "packed")
    if which.startswith("grpo"):
        assert (config.training.seq_len, config.grpo.max_completion_length) == (64 + 256, 256)


def test_the_conversations_are_of_mixed_lengths(data):
    rows = [json.loads(line) for line in (data / "chat.jsonl").read_text().splitlines()]
    words = sorted(sum(len(m["content"].split()) for m in r["messages"]) for r in rows)
    assert words[len(words) // 10] * 4 < words[-len(words) // 10]  # the longest tenth over 4x the shortest
    pairs = [json.loads(line) for line in (data / "preference.jsonl").read_text().splitlines()]
    assert all(p["chosen"][0]["content"] != p["rejected"][0]["content"] for p in pairs)
