"""`initial_load_path`: used when the run has no checkpoint of its own, and never ignored silently."""

import logging

import pytest

from titan_ckpt import Checkpointer, CheckpointError, LoadPolicy


def _pretrained(tmp_path, toy_run):
    run = toy_run(seed=11)
    run.train(3)
    Checkpointer(tmp_path / "pretrained", run.states()).save(3)
    return run, tmp_path / "pretrained" / "step-3"


def test_initial_weights_load_when_the_run_has_no_checkpoint(
    tmp_path, single_process_group, toy_run, same, caplog
):
    pretrained, path = _pretrained(tmp_path, toy_run)
    fresh = toy_run()
    ckpt = Checkpointer(
        tmp_path / "run",
        fresh.states(),
        loading=LoadPolicy(initial_load_path=path),
    )
    with caplog.at_level(logging.INFO):
        result = ckpt.load()
    assert (result.kind, result.path, result.states) == ("initial", path, ("model",))
    assert f"no checkpoint in {tmp_path / 'run'}; loading initial weights from {path}" in caplog.text
    assert same(fresh.weights(), pretrained.weights())
    assert fresh.progress.value == 0 and not fresh.optimizer.state  # model only: training starts over


def test_initial_full_state_loads_optimizer_and_progress_too(tmp_path, single_process_group, toy_run, same):
    pretrained, path = _pretrained(tmp_path, toy_run)
    fresh = toy_run()
    Checkpointer(
        tmp_path / "run",
        fresh.states(),
        loading=LoadPolicy(initial_load_path=path, initial_load_model_only=False),
    ).load()
    assert fresh.progress.value == 3
    assert same(fresh.optimizer_tensors(), pretrained.optimizer_tensors())


def test_initial_load_path_loses_to_the_runs_own_checkpoint_with_a_warning(
    tmp_path, single_process_group, toy_run, same, caplog
):
    _, path = _pretrained(tmp_path, toy_run)
    own = toy_run(seed=3)
    Checkpointer(tmp_path / "run", own.states()).save(5)
    fresh = toy_run()
    with caplog.at_level(logging.WARNING):
        result = Checkpointer(
            tmp_path / "run", fresh.states(), loading=LoadPolicy(initial_load_path=path)
        ).load()
    assert (result.kind, result.step) == ("resumed", 5)
    assert f"initial_load_path {path} is NOT loaded" in caplog.text
    assert same(fresh.weights(), own.weights())


def test_missing_initial_load_path_is_an_error_not_a_fresh_start(tmp_path, single_process_group, toy_run):
    with pytest.raises(CheckpointError, match=r"initial_load_path .*nowhere does not exist; fix the path"):
        Checkpointer(
            tmp_path / "run", toy_run().states(), loading=LoadPolicy(initial_load_path=tmp_path / "nowhere")
        ).load()


def test_initial_load_path_without_dcp_metadata_points_at_the_hf_switch(
    tmp_path, single_process_group, toy_run
):
    (tmp_path / "hf_like").mkdir()
    with pytest.raises(CheckpointError, match="is not a DCP checkpoint.*set initial_load_in_hf = true"):
        Checkpointer(
            tmp_path / "run", toy_run().states(), loading=LoadPolicy(initial_load_path=tmp_path / "hf_like")
        ).load()
