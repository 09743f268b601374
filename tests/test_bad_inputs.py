"""Bad input stops a run before training: one line naming the problem and the fix, on every rank alike,
a non-zero exit status, no traceback, and the checkpoint already in the run's folder left byte for byte."""

from __future__ import annotations

import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from titan_ckpt import Checkpointer, ModelState
from titan_models import ModelArgs, Transformer, llama3_args

sys.path.insert(0, str(Path(__file__).parent))
from fault_runs import cli_args, start_forked_ranks, tree_hashes  # noqa: E402


@dataclass(frozen=True)
class Case:
    name: str
    overrides: tuple[str, ...]
    says: tuple[str, ...]  # fragments of the one error line: the problem, then the fix
    nproc: int = 1
    checkpoint: str = "same_model"  # the checkpoint already in the folder: same_model or other_model


CASES = [
    Case(
        "unknown_toml_key",
        ("--job.config_file", "{inputs}/typo.toml"),
        ("unknown key 'stepz' in [training]", "did you mean 'steps'"),
    ),
    Case(
        "unknown_flag",
        ("--training.stesp", "5"),
        ("unknown flag '--training.stesp'", "did you mean '--training.steps'"),
    ),
    Case("wrong_type", ("--training.steps", "ten"), ("training.steps expects int, got 'ten'",)),
    Case(
        "value_not_a_choice", ("--optimizer.name", "SGD"), ("optimizer.name = 'SGD' is not one of", "'AdamW'")
    ),
    Case(
        "value_out_of_range",
        ("--training.local_batch_size", "0"),
        ("training.local_batch_size must be at least 1, got 0",),
    ),
    Case(
        "missing_config_file",
        ("--job.config_file", "{inputs}/nowhere.toml"),
        ("nowhere.toml does not exist",),
    ),
    Case("invalid_toml", ("--job.config_file", "{inputs}/broken.toml"), ("broken.toml is not valid TOML",)),
    Case(
        "unknown_flavor",
        ("--model.flavor", "9B"),
        ("model.flavor '9B' is not a llama3 flavor", "choose one of debugmodel"),
    ),
    Case(
        "seq_len_beyond_the_model",
        ("--training.seq_len", "262144"),
        (
            "training.seq_len = 262144 is beyond the 131072-token context of llama3 debugmodel",
            "set training.seq_len to at most 131072",
        ),
        nproc=2,
    ),
    Case(
        "missing_tokenizer",
        ("--model.hf_assets_path", "{inputs}/no_tokenizer"),
        ("no_tokenizer does not exist", "point the config at a folder with tokenizer.model"),
        nproc=2,
    ),
    Case(
        "unreadable_tokenizer",
        ("--model.hf_assets_path", "{inputs}/garbled_tokenizer"),
        ("garbled_tokenizer/tokenizer.json is not a readable tokenizers-library file",),
    ),
    Case(
        "signal_that_cannot_be_caught",
        ("--health.preemption_signals", "SIGTERM,SIGKILL"),
        (
            "health.preemption_signals has 'SIGKILL', which is not a signal a process can catch",
            "use names such as",
        ),
    ),
    Case(
        "empty_dataset",
        ("--training.dataset_path", "{inputs}/empty.jsonl"),
        ("empty.jsonl holds no documents",),
        nproc=2,
    ),
    Case(
        "unreadable_dataset",
        ("--training.dataset_path", "{inputs}/garbled.jsonl"),
        (
            "garbled.jsonl at byte 0 is not a JSON object with a 'text' field",
            "write one JSON object per line",
        ),
    ),
    Case(
        "missing_dataset",
        ("--training.dataset_path", "{inputs}/nowhere.jsonl"),
        ("nowhere.jsonl does not exist", "point the config at a dataset file or folder"),
    ),
    Case("unknown_dataset", ("--training.dataset", "c5"), ("unknown dataset 'c5'; registered: c4",)),
    Case(
        "checkpoint_of_another_model",
        (),
        (
            "'tok_embeddings.weight' in",
            "has shape [2048, 64] but the model expects [2048, 256]",
            "check the model flavor and vocabulary size",
        ),
        nproc=2,
        checkpoint="other_model",
    ),
    Case(
        "checkpoint_step_not_there",
        ("--checkpoint.load_step", "7"),
        ("load_step = 7, but", "has no complete step-7 (complete: step-2); pick one of those or set -1"),
    ),
    Case(
        "world_size_does_not_fit_the_layout",
        ("--parallelism.data_parallel_shard_degree", "4"),
        ("dp_shard(4) * cp(1) * tp(1) * pp(1) = 4, but WORLD_SIZE is 2", "set dp_shard = -1 to infer it"),
        nproc=2,
    ),
    Case(
        "global_batch_not_a_multiple",
        ("--training.global_batch_size", "3"),
        (
            "training.global_batch_size (3) must be a multiple of local_batch_size (2) * data-parallel degree (1) = 2",
        ),
    ),
]


def _write_checkpoint(folder: Path, args: ModelArgs) -> None:
    """A real Titan checkpoint (step-2, model weights) of a model with `args`, as a run leaves it."""
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights(buffer_device=torch.device("cpu"), seed=0)
    Checkpointer(folder, {"model": ModelState([model])}).save(2, wait=True)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, tuple[list[int | None], list[str], dict, dict]]:
    """Every case run once (a few at a time): exit statuses, each rank's output, checkpoint hashes before/after."""
    root = tmp_path_factory.mktemp("bad_inputs")
    inputs = root / "inputs"
    inputs.mkdir()
    (inputs / "typo.toml").write_text('[model]\nflavor = "debugmodel"\n[training]\nstepz = 5\n')
    (inputs / "broken.toml").write_text("[training\nsteps = 5\n")
    (inputs / "garbled_tokenizer").mkdir()
    (inputs / "garbled_tokenizer" / "tokenizer.json").write_bytes(bytes(range(256)) * 4)
    (inputs / "empty.jsonl").write_text("")
    (inputs / "garbled.jsonl").write_bytes(bytes(range(256)) * 4)
    checkpoints = {"same_model": root / "same_model", "other_model": root / "other_model"}
    _write_checkpoint(checkpoints["same_model"], llama3_args("debugmodel"))
    _write_checkpoint(checkpoints["other_model"], ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=2048))

    def run_case(case: Case):
        dump = root / case.name
        shutil.copytree(checkpoints[case.checkpoint], dump / "checkpoint")
        before = tree_hashes(dump / "checkpoint")
        overrides = [o.format(inputs=inputs) for o in case.overrides]
        argv = cli_args(dump, "--checkpoint.enable", "--training.steps", "2", *overrides)
        processes = start_forked_ranks(argv, case.nproc, dump)
        for process in processes:
            process.join(timeout=300)
        statuses = [process.exitcode for process in processes]
        outputs = [(dump / f"rank{rank}.log").read_text() for rank in range(case.nproc)]
        return statuses, outputs, before, tree_hashes(dump / "checkpoint")

    with ThreadPoolExecutor(max_workers=3) as pool:
        results = pool.map(run_case, CASES)
        return {case.name: result for case, result in zip(CASES, results, strict=True)}


def test_the_table_has_at_least_15_cases_and_some_run_on_two_ranks():
    assert len(CASES) >= 15
    assert sum(case.nproc == 2 for case in CASES) >= 3


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_bad_input_stops_before_training_with_one_line_on_every_rank(case, outcomes):
    statuses, outputs, before, after = outcomes[case.name]
    assert statuses == [2] * case.nproc, outputs
    lines = []
    for output in outputs:
        errors = [line for line in output.splitlines() if " ERROR " in line]
        assert len(errors) == 1, output[-3000:]
        assert "Traceback" not in output, output[-3000:]
        assert "step:" not in output and "training done" not in output  # stopped before training
        lines.append(errors[0].split(" ERROR ", 1)[1])
    assert len(set(lines)) == 1  # every rank says the same
    for fragment in case.says:
        assert fragment in lines[0], lines[0]
    assert after == before  # the checkpoint in the folder is untouched
