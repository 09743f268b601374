"""Expert-bias load balancing is layout-independent: a 2-rank data-parallel (FSDP) run of an MoE model
through titan-train routes, balances and trains as the one-process run of the same global batch,
because each step's tokens-per-expert counts are summed over the data-parallel ranks before the bias moves."""

import json
import os

import pytest

from tests.conftest import run_train

WORKERS = os.path.join(os.path.dirname(__file__), "workers")
TINY = (
    "--experimental.custom_import", "tiny_moe_flavor", "--model.name", "qwen3", "--model.flavor", "tiny_moe",
    "--training.seq_len", "32", "--training.steps", "4", "--metrics.log_freq", "1",
    "--activation_checkpoint.mode", "none", "--optimizer.lr", "1e-2", "--compile.enable", "false",
    "--training.dataloader.num_streams", "4", "--metrics.enable_tensorboard", "false",
)  # fmt: skip


def _records(dump):
    return {r["step"]: r for r in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.slow
def test_two_rank_data_parallel_run_balances_experts_as_one_process(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [WORKERS, os.environ.get("PYTHONPATH")])))
    runs = {}
    for name, nproc, local_batch in (("one", 1, "4"), ("dp2", 2, "2")):
        result = run_train(tmp_path / name, *TINY, "--training.local_batch_size", local_batch, nproc=nproc)
        assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
        runs[name] = _records(tmp_path / name)
    one, dp2 = runs["one"], runs["dp2"]
    assert sorted(one) == sorted(dp2) == [1, 2, 3, 4]
    for step in one:
        # Counts over the whole global batch (not one rank's half): the biases move identically, so
        # routing, losses and gradients stay those of one process step after step.
        assert dp2[step]["expert_counts"] == one[step]["expert_counts"], step
        assert dp2[step]["loss"] == pytest.approx(one[step]["loss"], abs=1e-5)
        assert dp2[step]["grad_norm"] == pytest.approx(one[step]["grad_norm"], abs=1e-5)
