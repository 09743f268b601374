"""A corrupt or mismatched checkpoint fails at load, naming the file and the key, and changes nothing."""

import re

import pytest
import torch
import torch.distributed.checkpoint as dcp

from titan_ckpt import Checkpointer, CheckpointError, LoadPolicy


def _saved(tmp_path, toy_run, **run_kwargs):
    run = toy_run(**run_kwargs)
    run.train(1)
    Checkpointer(tmp_path, run.states()).save(1)
    return tmp_path / "step-1"


def _storage(folder):
    """key -> (file, offset, length) as DCP recorded them."""
    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    return {i.fqn: (v.relative_path, v.offset, v.length) for i, v in metadata.storage_data.items()}


def _load_fails(tmp_path, toy_run, same, match, **run_kwargs):
    target = toy_run(seed=9, **run_kwargs)
    before = target.weights()
    with pytest.raises(CheckpointError, match=match):
        Checkpointer(tmp_path, target.states()).load()
    assert same(target.weights(), before), "a failed load must not have changed the model"


def test_truncated_file_is_named_with_the_key_it_cuts(tmp_path, single_process_group, toy_run, same):
    folder = _saved(tmp_path, toy_run)
    file, offset, _ = _storage(folder)["2.weight"]
    with open(folder / file, "r+b") as f:
        f.truncate(offset + 10)
    _load_fails(tmp_path, toy_run, same, rf"{re.escape(str(folder / file))} is truncated: .*'2\.weight'")


def test_missing_data_file_is_named(tmp_path, single_process_group, toy_run, same):
    folder = _saved(tmp_path, toy_run)
    file, _, _ = _storage(folder)["0.weight"]
    (folder / file).unlink()
    _load_fails(
        tmp_path, toy_run, same, rf"{re.escape(str(folder / file))} is missing \(it holds '0\.weight'\)"
    )


def test_missing_key_names_the_metadata_file_and_how_to_skip_that_state(
    tmp_path, single_process_group, toy_run, same
):
    run = toy_run()
    states = run.states()
    del states["dataloader"]
    Checkpointer(tmp_path, states).save(1)
    match = r"step-1/\.metadata has no key 'dataloader\.value'.*add 'dataloader' to exclude_from_loading"
    _load_fails(tmp_path, toy_run, same, match)


def test_shape_mismatch_names_the_file_and_the_key(tmp_path, single_process_group, toy_run, same):
    folder = _saved(tmp_path, toy_run, hidden=16)
    file, _, _ = _storage(folder)["0.weight"]
    match = (
        rf"'0\.weight' in {re.escape(str(folder / file))} has shape \[16, 8\] but the model expects \[32, 8\]"
    )
    _load_fails(tmp_path, toy_run, same, match, hidden=32)


def test_unreadable_metadata_is_named(tmp_path, single_process_group, toy_run, same):
    folder = _saved(tmp_path, toy_run)
    (folder / ".metadata").write_bytes(b"\x80garbage")
    _load_fails(tmp_path, toy_run, same, rf"cannot read {re.escape(str(folder / '.metadata'))}")


def test_loading_a_valid_checkpoint_into_a_lower_precision_model_casts(
    tmp_path, single_process_group, toy_run
):
    source = toy_run()
    Checkpointer(tmp_path, source.states()).save(1)
    target = toy_run(seed=4)
    target.model.to(torch.bfloat16)
    Checkpointer(tmp_path, target.states(), loading=LoadPolicy(exclude_from_loading=["optimizer"])).load()
    for name, tensor in target.model.state_dict().items():
        assert torch.equal(tensor, source.model.state_dict()[name].to(torch.bfloat16))
