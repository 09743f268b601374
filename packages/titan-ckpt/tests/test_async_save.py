"""Saves in each async mode hold the state as it was when `save` was called, while training goes on."""

import logging

import pytest

from titan_ckpt import ASYNC_MODES, Checkpointer, complete_steps


@pytest.mark.parametrize("mode", ASYNC_MODES)
def test_background_save_holds_the_state_of_its_step_although_training_continues(
    tmp_path, single_process_group, toy_run, same, mode
):
    run = toy_run()
    ckpt = Checkpointer(tmp_path, run.states(), interval=2, async_mode=mode)
    run.train(2)
    assert ckpt.maybe_save(2)
    at_step_2 = (run.weights(), run.optimizer_tensors(), run.data.value)
    # Keep training at once: the optimizer steps must not leak into the checkpoint being written.
    for step in (3, 4, 5):
        run.train(1)
        ckpt.maybe_save(step)
    ckpt.close()
    assert complete_steps(tmp_path) == [2, 4]

    fresh = toy_run(seed=1)
    Checkpointer(tmp_path, fresh.states(), interval=2, load_step=2).load()
    assert same(fresh.weights(), at_step_2[0])
    assert same(fresh.optimizer_tensors(), at_step_2[1])
    assert fresh.data.value == at_step_2[2]


@pytest.mark.parametrize("mode", ASYNC_MODES)
def test_each_save_records_how_long_it_blocked_training(tmp_path, single_process_group, toy_run, mode):
    run = toy_run()
    ckpt = Checkpointer(tmp_path, run.states(), interval=1, async_mode=mode)
    for step in (1, 2, 3):
        run.train(1)
        ckpt.maybe_save(step)
    ckpt.close()
    assert [t.step for t in ckpt.timings] == [1, 2, 3]
    assert all(0 <= t.blocked_s <= t.total_s and t.bytes_written > 0 for t in ckpt.timings)


def test_pinned_memory_mode_says_it_has_no_pinned_memory_without_cuda(
    tmp_path, single_process_group, toy_run, caplog
):
    with caplog.at_level(logging.WARNING):
        Checkpointer(tmp_path, toy_run().states(), interval=1, async_mode="async_with_pinned_mem").close()
    assert "async_with_pinned_mem needs CUDA for pinned memory" in caplog.text


def test_last_step_save_waits_for_the_background_save_and_writes_synchronously(
    tmp_path, single_process_group, toy_run
):
    run = toy_run()
    ckpt = Checkpointer(tmp_path, run.states(), interval=1, async_mode="async")
    run.train(1)
    ckpt.maybe_save(1)
    run.train(1)
    ckpt.maybe_save(2, last_step=True)
    assert complete_steps(tmp_path) == [1, 2]  # both published before maybe_save returned
    ckpt.close()
