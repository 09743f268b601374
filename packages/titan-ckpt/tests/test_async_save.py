"""Saves in each async mode hold the state as it was when `save` was called, while training goes on."""

import logging
import time

import pytest
from torch.distributed.checkpoint.staging import DefaultStager

from titan_ckpt import ASYNC_MODES, Checkpointer, LoadPolicy, SavePolicy, complete_steps


@pytest.mark.parametrize("mode", ASYNC_MODES)
def test_background_save_holds_the_state_of_its_step_although_training_continues(
    tmp_path, single_process_group, toy_run, same, mode
):
    run = toy_run()
    ckpt = Checkpointer(tmp_path, run.states(), saving=SavePolicy(interval=2, async_mode=mode))
    run.train(2)
    assert ckpt.maybe_save(2)
    at_step_2 = (run.weights(), run.optimizer_tensors(), run.data.value)
    # Keep training at once: the optimizer steps must not leak into the checkpoint being written.
    for step in (3, 4, 5):
        run.train(1, before_optimizer_step=ckpt.wait_for_staging)
        ckpt.maybe_save(step)
    ckpt.close()
    assert complete_steps(tmp_path) == [2, 4]

    fresh = toy_run(seed=1)
    Checkpointer(tmp_path, fresh.states(), loading=LoadPolicy(load_step=2)).load()
    assert same(fresh.weights(), at_step_2[0])
    assert same(fresh.optimizer_tensors(), at_step_2[1])
    assert fresh.data.value == at_step_2[2]


@pytest.mark.parametrize("mode", ASYNC_MODES)
def test_each_save_records_how_long_it_blocked_training(tmp_path, single_process_group, toy_run, mode):
    run = toy_run()
    ckpt = Checkpointer(tmp_path, run.states(), saving=SavePolicy(interval=1, async_mode=mode))
    for step in (1, 2, 3):
        run.train(1, before_optimizer_step=ckpt.wait_for_staging)
        ckpt.maybe_save(step)
    ckpt.close()
    assert [t.step for t in ckpt.timings] == [1, 2, 3]
    assert all(0 <= t.blocked_s <= t.total_s and t.bytes_written > 0 for t in ckpt.timings)


def test_a_step_after_wait_for_staging_leaves_a_slow_background_copy_untouched(
    tmp_path, single_process_group, toy_run, same, monkeypatch
):
    """The copy of async_with_pinned_mem runs beside training; here it takes 0.5 s, so a step that did
    not wait would change the weights while they are being copied."""
    copy = DefaultStager._stage

    def slow_copy(self, state_dict, **kwargs):
        time.sleep(0.5)
        return copy(self, state_dict, **kwargs)

    monkeypatch.setattr(DefaultStager, "_stage", slow_copy)
    run = toy_run()
    ckpt = Checkpointer(
        tmp_path, run.states(), saving=SavePolicy(interval=1, async_mode="async_with_pinned_mem")
    )
    run.train(1)
    ckpt.save(1)
    at_save = run.weights()
    run.train(1, before_optimizer_step=ckpt.wait_for_staging)
    ckpt.close()
    assert ckpt.timings[0].blocked_s >= 0.3  # the wait is counted as time the save blocked training

    fresh = toy_run(seed=1)
    Checkpointer(tmp_path, fresh.states()).load()
    assert same(fresh.weights(), at_save)


def test_pinned_memory_mode_says_it_has_no_pinned_memory_without_cuda(
    tmp_path, single_process_group, toy_run, caplog
):
    with caplog.at_level(logging.WARNING):
        Checkpointer(
            tmp_path, toy_run().states(), saving=SavePolicy(async_mode="async_with_pinned_mem")
        ).close()
    assert "async_with_pinned_mem needs CUDA for pinned memory" in caplog.text


def test_last_step_save_waits_for_the_background_save_and_writes_synchronously(
    tmp_path, single_process_group, toy_run
):
    run = toy_run()
    ckpt = Checkpointer(tmp_path, run.states(), saving=SavePolicy(interval=1, async_mode="async"))
    run.train(1)
    ckpt.maybe_save(1)
    run.train(1)
    ckpt.maybe_save(2, last_step=True)
    assert complete_steps(tmp_path) == [1, 2]  # both published before maybe_save returned
    ckpt.close()
