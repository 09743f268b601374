"""The Checkpointer on a one-rank gloo group: saving, resuming, retention and every [checkpoint] switch."""

import logging

import pytest
import torch
import torch.distributed.checkpoint as dcp

from titan_ckpt import Checkpointer, CheckpointError, LastSavePolicy, LoadPolicy, SavePolicy, complete_steps


def test_save_then_load_restores_model_optimizer_and_objects_bit_exactly(
    tmp_path, single_process_group, toy_run, same
):
    run = toy_run()
    run.train(3)
    Checkpointer(tmp_path, run.states()).save(3)

    fresh = toy_run(seed=1)
    result = Checkpointer(tmp_path, fresh.states()).load()
    assert (result.kind, result.step) == ("resumed", 3)
    assert (fresh.data.value, fresh.progress.value) == (3, 3)
    assert same(fresh.weights(), run.weights())
    assert same(fresh.optimizer_tensors(), run.optimizer_tensors())
    assert run.train(2) == fresh.train(2)
    assert same(fresh.weights(), run.weights())


def test_model_is_stored_under_its_own_names_and_other_states_under_theirs(
    tmp_path, single_process_group, toy_run
):
    run = toy_run()
    Checkpointer(tmp_path, run.states()).save(1)
    keys = set(dcp.FileSystemReader(str(tmp_path / "step-1")).read_metadata().state_dict_metadata)
    assert {"0.weight", "0.bias", "2.weight", "2.bias", "dataloader.value", "train_state.value"} <= keys
    assert any(k.startswith("optimizer.") for k in keys)


def test_keep_latest_k_2_leaves_exactly_the_two_newest_step_folders_after_5_saves(
    tmp_path, single_process_group, toy_run
):
    run = toy_run()
    ckpt = Checkpointer(tmp_path, run.states(), saving=SavePolicy(interval=2, keep_latest_k=2))
    saved = [step for step in range(1, 11) if ckpt.maybe_save(step)]
    assert saved == [2, 4, 6, 8, 10]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-10", "step-8"]
    assert complete_steps(tmp_path) == [8, 10]


def test_keep_latest_k_0_keeps_every_checkpoint(tmp_path, single_process_group, toy_run):
    ckpt = Checkpointer(tmp_path, toy_run().states(), saving=SavePolicy(interval=1, keep_latest_k=0))
    for step in range(1, 5):
        ckpt.maybe_save(step)
    assert complete_steps(tmp_path) == [1, 2, 3, 4]


def test_partial_folder_from_a_crash_is_skipped_with_a_warning_and_removed(
    tmp_path, single_process_group, toy_run, caplog
):
    run = toy_run()
    ckpt = Checkpointer(tmp_path, run.states())
    ckpt.save(1)
    # What a kill mid-save leaves: a newer folder that was never published, with a plausible shard.
    partial = tmp_path / "step-2.partial"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half written")
    with caplog.at_level(logging.WARNING):
        result = Checkpointer(tmp_path, toy_run(seed=1).states()).load()
    assert result.step == 1
    assert "step-2.partial" in caplog.text and "skipping" in caplog.text
    assert not partial.exists()


def test_no_checkpoint_says_fresh_start(tmp_path, single_process_group, toy_run, caplog):
    with caplog.at_level(logging.INFO):
        result = Checkpointer(tmp_path / "none", toy_run().states()).load()
    assert result.kind == "fresh"
    assert "no checkpoint" in caplog.text and "fresh start" in caplog.text


def test_resume_says_resuming_from_step_n(tmp_path, single_process_group, toy_run, caplog):
    Checkpointer(tmp_path, toy_run().states()).save(7)
    with caplog.at_level(logging.INFO):
        Checkpointer(tmp_path, toy_run().states()).load()
    assert "resuming from step-7" in caplog.text


def test_first_step_checkpoint_is_written_only_when_enabled(tmp_path, single_process_group, toy_run):
    assert not Checkpointer(tmp_path / "off", toy_run().states(), saving=SavePolicy(interval=5)).maybe_save(1)
    on = Checkpointer(
        tmp_path / "on", toy_run().states(), saving=SavePolicy(interval=5, enable_first_step_checkpoint=True)
    )
    assert on.maybe_save(1)
    assert complete_steps(tmp_path / "on") == [1]


def test_last_step_is_always_saved_even_off_interval(tmp_path, single_process_group, toy_run):
    ckpt = Checkpointer(tmp_path, toy_run().states(), saving=SavePolicy(interval=10))
    assert ckpt.maybe_save(7, last_step=True)
    assert complete_steps(tmp_path) == [7]


def test_load_only_restores_but_never_saves(tmp_path, single_process_group, toy_run):
    run = toy_run()
    run.train(2)
    Checkpointer(tmp_path, run.states()).save(2)
    fresh = toy_run(seed=3)
    ckpt = Checkpointer(tmp_path, fresh.states(), saving=SavePolicy(interval=1, load_only=True))
    assert ckpt.load().step == 2
    assert not ckpt.maybe_save(3) and not ckpt.maybe_save(4, last_step=True)
    assert complete_steps(tmp_path) == [2]


def test_load_step_restores_that_step_rather_than_the_newest(tmp_path, single_process_group, toy_run, same):
    run = toy_run()
    ckpt = Checkpointer(tmp_path, run.states())
    run.train(1)
    ckpt.save(1)
    at_step_1 = run.weights()
    run.train(1)
    ckpt.save(2)
    fresh = toy_run(seed=5)
    result = Checkpointer(tmp_path, fresh.states(), loading=LoadPolicy(load_step=1)).load()
    assert (result.kind, result.step) == ("resumed", 1)
    assert same(fresh.weights(), at_step_1) and fresh.progress.value == 1


def test_missing_load_step_fails_listing_the_complete_steps(tmp_path, single_process_group, toy_run):
    Checkpointer(tmp_path, toy_run().states()).save(4)
    with pytest.raises(CheckpointError, match=r"load_step = 3.*no complete step-3.*complete: step-4"):
        Checkpointer(tmp_path, toy_run().states(), loading=LoadPolicy(load_step=3)).load()


def test_exclude_from_loading_leaves_that_state_as_it_is(tmp_path, single_process_group, toy_run, same):
    run = toy_run()
    run.train(3)
    Checkpointer(tmp_path, run.states()).save(3)
    fresh = toy_run(seed=1)
    fresh.data.value = 42
    Checkpointer(tmp_path, fresh.states(), loading=LoadPolicy(exclude_from_loading=["dataloader"])).load()
    assert fresh.data.value == 42 and fresh.progress.value == 3
    assert same(fresh.weights(), run.weights())


def test_the_last_save_is_full_and_the_model_only_export_in_the_export_dtype_lies_beside_it(
    tmp_path, single_process_group, toy_run, same
):
    run = toy_run()
    run.train(2)
    ckpt = Checkpointer(
        tmp_path,
        run.states(),
        saving=SavePolicy(interval=100),
        last_save=LastSavePolicy(model_only=True, export_dtype="bfloat16"),
    )
    ckpt.maybe_save(2, last_step=True)
    assert ckpt.export_folder(2) == tmp_path / "step-2" / "model_only"
    metadata = dcp.FileSystemReader(str(ckpt.export_folder(2))).read_metadata().state_dict_metadata
    assert set(metadata) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert {m.properties.dtype for m in metadata.values()} == {torch.bfloat16}
    saved = {k: torch.empty(m.size, dtype=torch.bfloat16) for k, m in metadata.items()}
    dcp.load(saved, checkpoint_id=str(ckpt.export_folder(2)))
    assert all(torch.equal(saved[k], v.to(torch.bfloat16)) for k, v in run.weights().items())
    # step-2 itself is full: a longer run resumes from it, optimizer and data position included.
    fresh = toy_run(seed=1)
    result = Checkpointer(tmp_path, fresh.states(), saving=SavePolicy(keep_latest_k=1)).load()
    assert (result.kind, result.step) == ("resumed", 2)
    assert same(fresh.optimizer_tensors(), run.optimizer_tensors()) and fresh.data.value == 2
    assert run.train(1) == fresh.train(1)


def test_a_newest_model_only_checkpoint_is_passed_over_for_the_newest_full_one(
    tmp_path, single_process_group, toy_run, same, caplog
):
    run = toy_run()
    ckpt = Checkpointer(tmp_path, run.states(), saving=SavePolicy(interval=2))
    run.train(2)
    ckpt.maybe_save(2)
    at_step_2 = run.weights()
    run.train(1)
    ckpt.save(3, model_only=True)  # as a seed checkpoint or an older Titan's last save leaves it
    fresh = toy_run(seed=1)
    with caplog.at_level(logging.WARNING):
        result = Checkpointer(tmp_path, fresh.states()).load()
    assert (result.kind, result.step) == ("resumed", 2)
    assert "step-3 holds only model weights" in caplog.text
    assert same(fresh.weights(), at_step_2) and fresh.progress.value == 2


class _SplitPosition:
    """A progress counter whose newer versions save one key more, which older checkpoints lack."""

    optional_keys = ("planned",)

    def __init__(self):
        self.value, self.planned = 0, None

    def state_dict(self):
        return {"value": self.value, "planned": self.planned if self.planned is not None else -1}

    def load_state_dict(self, state):
        self.value, self.planned = state["value"], state.get("planned")


def test_optional_keys_may_be_missing_and_a_state_in_another_format_is_named(
    tmp_path, single_process_group, toy_run
):
    run = toy_run()
    run.train(1)
    Checkpointer(tmp_path, run.states()).save(1)
    fresh = toy_run(seed=1)
    states = {**fresh.states(), "train_state": _SplitPosition()}
    Checkpointer(tmp_path, states).load()
    assert (states["train_state"].value, states["train_state"].planned) == (1, None)

    class OtherLoader:
        def state_dict(self):
            return {"dp_rank_0": b"", "world_size": 1}

        def load_state_dict(self, state):
            raise AssertionError("never loaded")

    states = {**toy_run(seed=1).states(), "dataloader": OtherLoader()}
    with pytest.raises(CheckpointError) as err:
        Checkpointer(tmp_path, states).load()
    assert str(err.value).startswith("checkpoint: the 'dataloader' state in")
    assert "another format than this run's (saved keys value; this run reads dp_rank_0, world_size)" in str(
        err.value
    )
    assert "add 'dataloader' to checkpoint.exclude_from_loading" in str(err.value)


class _RenamedPosition:
    """A progress counter whose key was renamed from `value` to `count`."""

    older_keys = {"count": "value"}

    def __init__(self):
        self.count = 0

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def test_a_key_saved_under_its_older_name_is_read_under_the_new_one_and_said(
    tmp_path, single_process_group, toy_run, caplog
):
    run = toy_run()
    run.train(2)
    Checkpointer(tmp_path, run.states()).save(2)  # its train_state saves {"value": 2}
    states = {**toy_run(seed=1).states(), "train_state": _RenamedPosition()}
    with caplog.at_level(logging.INFO):
        Checkpointer(tmp_path, states).load()
    assert states["train_state"].count == 2
    assert (
        "holds train_state.value, the older name of train_state.count; read as train_state.count"
        in caplog.text
    )
    # A checkpoint with the new name reads it, not the old one.
    states["train_state"].count = 5
    Checkpointer(tmp_path / "new", states).save(1)
    again = {**toy_run(seed=1).states(), "train_state": _RenamedPosition()}
    Checkpointer(tmp_path / "new", again).load()
    assert again["train_state"].count == 5


def test_seed_checkpoint_loads_model_weights_only(tmp_path, single_process_group, toy_run, same):
    seed_run = toy_run(seed=7)
    Checkpointer(tmp_path, seed_run.states()).save(0, model_only=True)
    fresh = toy_run(seed=1)
    fresh_optimizer_state = fresh.optimizer.state_dict()
    result = Checkpointer(tmp_path, fresh.states()).load()
    assert (result.kind, result.step, result.states) == ("model_only", 0, ("model",))
    assert same(fresh.weights(), seed_run.weights())
    assert fresh.optimizer.state_dict() == fresh_optimizer_state and fresh.progress.value == 0


def test_saving_a_step_again_replaces_its_folder(tmp_path, single_process_group, toy_run, same):
    run = toy_run()
    ckpt = Checkpointer(tmp_path, run.states())
    ckpt.save(1)
    run.train(1)
    ckpt.save(1)
    fresh = toy_run(seed=2)
    Checkpointer(tmp_path, fresh.states()).load()
    assert same(fresh.weights(), run.weights())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        (lambda: SavePolicy(interval=0), "interval must be >= 1, got 0"),
        (lambda: SavePolicy(keep_latest_k=-1), "keep_latest_k must be >= 0"),
        (lambda: LoadPolicy(load_step=-2), "load_step must be a step >= 0, or -1"),
        (
            lambda: SavePolicy(async_mode="threads"),
            "async_mode 'threads' is not one of disabled, async, async_with_pinned_mem",
        ),
        (lambda: LastSavePolicy(export_dtype="int8"), "export_dtype 'int8' is not one of"),
        (
            lambda: LastSavePolicy(in_hf=True),
            "last_save_in_hf saves only the model; set last_save_model_only = true",
        ),
        (
            lambda: LoadPolicy(initial_load_in_hf=True, initial_load_model_only=False),
            "set initial_load_model_only = true",
        ),
    ],
)
def test_a_policy_refuses_an_invalid_option_naming_the_value_and_the_fix(policy, message):
    with pytest.raises(CheckpointError, match=message):
        policy()


@pytest.mark.parametrize(
    ("policies", "message"),
    [
        (
            {"loading": LoadPolicy(exclude_from_loading=["loader"])},
            r"exclude_from_loading names \['loader'\].*choose from",
        ),
        ({"last_save": LastSavePolicy(model_only=True, in_hf=True)}, "need a Hugging Face weight mapping"),
    ],
)
def test_policies_that_do_not_fit_the_states_are_refused(toy_run, policies, message):
    with pytest.raises(CheckpointError, match=message):
        Checkpointer("unused", toy_run().states(), **policies)


def test_a_state_without_state_dict_is_refused():
    with pytest.raises(CheckpointError, match="state 'step'.*needs state_dict"):
        Checkpointer("unused", {"step": 3})
