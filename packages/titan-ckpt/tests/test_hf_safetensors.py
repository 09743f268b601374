"""Hugging Face export and import of model weights as sharded safetensors, through a caller's mapping."""

import json
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from titan_ckpt import Checkpointer, CheckpointError, LastSavePolicy, LoadPolicy, SavePolicy


class ToyAdapter:
    """Renames the toy model's weights the Hugging Face way and stores the first layer transposed,
    so a mapping that only renamed would be caught."""

    NAMES = {
        "0.weight": "model.up_proj.weight",
        "0.bias": "model.up_proj.bias",
        "2.weight": "lm_head.weight",
        "2.bias": "lm_head.bias",
    }

    def to_hf(self, state_dict):
        hf = {self.NAMES[k]: v for k, v in state_dict.items()}
        hf["model.up_proj.weight"] = hf["model.up_proj.weight"].t()
        return hf

    def from_hf(self, hf_state_dict):
        ours = {k: hf_state_dict[v] for k, v in self.NAMES.items()}
        ours["0.weight"] = ours["0.weight"].t()
        return ours

    def hf_config(self):
        return {"model_type": "toy", "hidden_size": 16, "architectures": ["ToyForCausalLM"]}


def _hf_checkpointer(folder, run, **last_save):
    return Checkpointer(
        folder,
        run.states(),
        saving=SavePolicy(interval=100),
        last_save=LastSavePolicy(model_only=True, in_hf=True, **last_save),
        hf_adapter=ToyAdapter(),
    )


def test_last_save_in_hf_writes_sharded_safetensors_an_index_and_config(
    tmp_path, single_process_group, toy_run
):
    run = toy_run()
    run.train(2)
    ckpt = _hf_checkpointer(
        tmp_path,
        run,
        export_dtype="bfloat16",
        max_shard_bytes=200,
        hf_extra_files={"tokenizer.json": b'{"toy": 1}'},
    )
    ckpt.maybe_save(2, last_step=True)
    folder = tmp_path / "step-2"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert sorted(set(index["weight_map"].values())) == files
    assert json.loads((folder / "config.json").read_text()) == {
        **ToyAdapter().hf_config(),
        "torch_dtype": "bfloat16",
    }
    assert (folder / "tokenizer.json").read_bytes() == b'{"toy": 1}'
    assert (folder / ".metadata").is_file()  # the full checkpoint, beside the Hugging Face files

    expected = {k: v.to(torch.bfloat16) for k, v in ToyAdapter().to_hf(run.weights()).items()}
    assert set(index["weight_map"]) == set(expected)
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in expected.values())
    for name, file in index["weight_map"].items():
        with safe_open(str(folder / file), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            assert torch.equal(f.get_tensor(name), expected[name])


def test_hf_export_then_import_as_initial_weights_is_exact(
    tmp_path, single_process_group, toy_run, same, caplog
):
    run = toy_run()
    run.train(2)
    _hf_checkpointer(tmp_path / "first", run, max_shard_bytes=200).maybe_save(2, last_step=True)
    fresh = toy_run(seed=5)
    ckpt = Checkpointer(
        tmp_path / "run",
        fresh.states(),
        loading=LoadPolicy(initial_load_path=tmp_path / "first" / "step-2", initial_load_in_hf=True),
        hf_adapter=ToyAdapter(),
    )
    with caplog.at_level("INFO"):
        result = ckpt.load()
    assert (result.kind, result.hf) == ("initial", True)
    assert "loading initial weights from" in caplog.text and "Hugging Face" in caplog.text
    assert same(fresh.weights(), run.weights())


def test_a_single_file_hf_model_without_index_loads(tmp_path, single_process_group, toy_run, same):
    pretrained = toy_run(seed=8)
    (tmp_path / "hf").mkdir()
    hf = {k: v.contiguous() for k, v in ToyAdapter().to_hf(pretrained.weights()).items()}
    save_file(hf, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    fresh = toy_run()
    Checkpointer(
        tmp_path / "run",
        fresh.states(),
        loading=LoadPolicy(initial_load_path=tmp_path / "hf", initial_load_in_hf=True),
        hf_adapter=ToyAdapter(),
    ).load()
    assert same(fresh.weights(), pretrained.weights())


def test_a_hf_step_folder_resumes_as_model_weights_when_nothing_else_exists(
    tmp_path, single_process_group, toy_run, same
):
    """torchtitan's last_save_in_hf writes its Hugging Face files alone as `step-N`."""
    run = toy_run()
    run.train(1)
    _hf_checkpointer(tmp_path, run).maybe_save(1, last_step=True)
    for dcp_file in [*(tmp_path / "step-1").glob("*.distcp"), tmp_path / "step-1" / ".metadata"]:
        dcp_file.unlink()
    fresh = toy_run(seed=2)
    result = _hf_checkpointer(tmp_path, fresh).load()
    assert (result.kind, result.step, result.hf) == ("model_only", 1, True)
    assert same(fresh.weights(), run.weights())


def _exported(tmp_path, toy_run):
    run = toy_run()
    _hf_checkpointer(tmp_path / "first", run, max_shard_bytes=200).maybe_save(1, last_step=True)
    return tmp_path / "first" / "step-1"


def _import_fails(tmp_path, toy_run, folder, match, **run_kwargs):
    ckpt = Checkpointer(
        tmp_path / "run",
        toy_run(**run_kwargs).states(),
        loading=LoadPolicy(initial_load_path=folder, initial_load_in_hf=True),
        hf_adapter=ToyAdapter(),
    )
    with pytest.raises(CheckpointError, match=match):
        ckpt.load()


def test_truncated_safetensors_file_is_named(tmp_path, single_process_group, toy_run):
    folder = _exported(tmp_path, toy_run)
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-40])
    _import_fails(tmp_path, toy_run, folder, rf"cannot read {re.escape(str(shard))}.*truncated")


def test_a_tensor_missing_from_its_listed_file_is_named_with_its_key(tmp_path, single_process_group, toy_run):
    folder = _exported(tmp_path, toy_run)
    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shard = sorted(folder.glob("model-*.safetensors"))[0]
    index["weight_map"]["model.extra.weight"] = shard.name
    index_file.write_text(json.dumps(index))
    _import_fails(tmp_path, toy_run, folder, rf"{re.escape(str(shard))} has no tensor 'model\.extra\.weight'")


def test_hf_weights_of_another_shape_are_refused_naming_the_key(tmp_path, single_process_group, toy_run):
    folder = _exported(tmp_path, toy_run)
    _import_fails(
        tmp_path,
        toy_run,
        folder,
        r"'0\.weight' from .* has shape \[16, 8\] but the model expects \[32, 8\]",
        hidden=32,
    )


def test_float8_weights_without_quantization_config_load_with_initial_load_in_hf_quantized_only(
    tmp_path, single_process_group, toy_run, same
):
    """torchtitan's switch: a folder whose config.json does not declare the float8 blocks (one 128x128
    block covers each toy matrix) is refused naming the switch, and dequantised with it."""
    hf = {k: v.contiguous() for k, v in ToyAdapter().to_hf(toy_run(seed=9).weights()).items()}
    files, dequantised = {}, {}
    for name, t in hf.items():
        if t.ndim == 2:
            scale = t.abs().max() / 448
            files[name] = (t / scale).to(torch.float8_e4m3fn)
            files[f"{name}_scale_inv"] = scale.reshape(1, 1)
            dequantised[name] = files[name].to(torch.float32) * scale
        else:
            files[name] = dequantised[name] = t
    (tmp_path / "hf").mkdir()
    save_file(files, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})

    def load(quantized: bool):
        run = toy_run()
        loading = LoadPolicy(
            initial_load_path=tmp_path / "hf", initial_load_in_hf=True, initial_load_in_hf_quantized=quantized
        )
        Checkpointer(
            tmp_path / f"run_{quantized}", run.states(), loading=loading, hf_adapter=ToyAdapter()
        ).load()
        return run

    with pytest.raises(CheckpointError, match="initial_load_in_hf_quantized = true"):
        load(False)
    assert same(load(True).weights(), ToyAdapter().from_hf(dequantised))
    assert not same(ToyAdapter().from_hf(dequantised), ToyAdapter().from_hf(hf))
