"""A trained expert bias, which the Hugging Face classes of Llama 4 and Qwen3-MoE cannot hold, is never
dropped without a word: `last_save_in_hf` is refused at start, the export itself stops naming the layers
and the largest value, and with `checkpoint.hf_export_lossy` the export loads in transformers (which
computes the model without the bias) while Titan's own re-import gives back the trained model exactly."""

import json
import logging
import shutil
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from titan_ckpt import TITAN_WEIGHT_MAP, CheckpointError, ModelState
from titan_ckpt.hf_export import write_hf_export
from titan_ckpt.hf_safetensors import TITAN_STATE_FILE
from titan_models import qwen3
from titan_train.cli import run
from titan_train.commands.checkpoint_model import load_checkpoint_model
from titan_train.plan import resolve
from titan_train.registry import get_model_family, register_flavor
from titan_train.trainer import Trainer
from titan_train.wiring.checkpointing import hf_adapter_for

register_flavor(
    "qwen3",
    "hf_unheld_2l",
    replace(
        qwen3.QWEN3_FLAVORS["debugmodel_moe"],
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        moe_inter_dim=64,
        moe_args=qwen3.qwen3_moe_args(8, 2),
    ),
)
register_flavor(
    "llama4", "hf_unheld_2l", get_model_family("llama4").args_for("debugmodel", n_layers=2, dim=64)
)
FAMILIES = ["qwen3", "llama4"]
EXPORT = (
    "--checkpoint.enable",
    "--checkpoint.last_save_in_hf",
    "--training.steps",
    "4",
    "--optimizer.lr",
    "1e-2",
)


def _model(name: str) -> tuple[str, ...]:
    # Qwen3-MoE, as torchtitan's, trains no expert bias by default: these runs switch balancing on.
    balancing = ("--model.moe_load_balance_coeff", "1e-3") if name == "qwen3" else ()
    return ("--model.name", name, "--model.flavor", "hf_unheld_2l", *balancing)


def test_an_export_of_a_run_that_trains_no_expert_bias_is_not_refused(tmp_path):
    plain = ("--model.name", "qwen3", "--model.flavor", "hf_unheld_2l")  # Qwen3-MoE's default: no balancing
    off = ("--model.name", "llama4", "--model.flavor", "hf_unheld_2l", "--model.moe_load_balance_coeff", "0")
    for name, model in (("qwen3", plain), ("llama4", off)):
        dump = ("--job.dump_folder", str(tmp_path / name), "--training.seq_len", "32")
        assert run([*dump, *model, *EXPORT, "--training.steps", "1"]) == 0  # the later flag wins
        assert (tmp_path / name / "checkpoint" / "step-1" / "model.safetensors.index.json").is_file()


@pytest.mark.parametrize("name", FAMILIES)
def test_an_export_that_would_drop_the_trained_expert_bias_is_refused_at_start(tmp_path, caplog, name):
    argv = ["--job.dump_folder", str(tmp_path), "--training.seq_len", "32", *_model(name), *EXPORT]
    with caplog.at_level(logging.ERROR):
        assert run(argv) == 2
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert line.startswith(f"config: checkpoint.last_save_in_hf: {name} hf_unheld_2l trains moe.expert_bias")
    assert "checkpoint.hf_export_lossy = true" in line
    assert not (tmp_path / "checkpoint").exists()


@pytest.mark.parametrize("name", FAMILIES)
def test_with_the_opt_in_transformers_loads_it_and_titan_s_reimport_is_exact(
    tmp_path, small_config, one_rank, caplog, name
):
    config = small_config(tmp_path / "run", *_model(name), *EXPORT, "--checkpoint.hf_export_lossy")
    with caplog.at_level(logging.WARNING):
        trained = Trainer(resolve(config, 1, "cpu"), one_rank)
        trained.train()
    model = trained.model_parts[0].eval()
    biases = {k: v for k, v in model.state_dict().items() if k.endswith("moe.expert_bias")}
    assert biases and all(b.abs().max().item() > 0 for b in biases.values())
    largest = max(b.abs().max().item() for b in biases.values())
    layers = ", ".join(k.split(".")[1] for k in sorted(biases))  # qwen3: both blocks; llama4: every other
    (warning,) = [r.getMessage() for r in caplog.records if "cannot hold" in r.getMessage()]
    assert f"moe.expert_bias of layers {layers} (largest |value| {largest:.3g}" in warning
    # With the share of the last batch's routings the bias changes, as titan_train.wiring.hf_unheld.BiasEffect
    # counted it on every MoE layer with a bias (the count itself: test_moe.py's
    # test_the_bias_effect_counts_the_tokens_whose_experts_the_bias_changes).
    effect = trained.checkpointer.hf_unheld_effect
    changed, total = effect()
    assert len(effect._last) == len(biases) and 0 < changed < total
    assert (
        f"({100 * changed / total:.1f}% of the last training batch's token routings pick other experts)"
        in warning
    )

    # Without the opt-in the export itself stops, with the same numbers, on the trained state.
    adapter = hf_adapter_for(trained.plan.family, model.args)
    with pytest.raises(CheckpointError, match=rf"of layers {layers} \(largest \|value\| .*hf_export_lossy"):
        write_hf_export(
            tmp_path / "refused",
            ModelState([model]).state_dict(),
            adapter,
            adapter.hf_config(),
            dtype=torch.float32,
            max_shard_bytes=10**9,
        )

    export = tmp_path / "run" / "checkpoint" / "step-4"
    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(3))
    hf = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    with torch.no_grad():
        ours = model(tokens)
        saved = {k: v.clone() for k, v in biases.items()}
        for bias in biases.values():
            bias.zero_()
        without_bias = model(tokens)
        for k, bias in biases.items():
            bias.copy_(saved[k])
        # transformers computes the trained weights with no expert bias
        assert (hf(tokens).logits - without_bias).abs().max().item() <= 1e-5

    reimport = small_config(
        tmp_path / "again",
        *_model(name),
        "--checkpoint.enable",
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.initial_load_path",
        str(export),
        "--training.steps",
        "0",
    )
    loaded = Trainer(resolve(reimport, 1, "cpu"), one_rank)
    loaded.train()
    theirs = loaded.model_parts[0].eval().state_dict()
    assert all(
        torch.equal(theirs[k], v) for k, v in model.state_dict().items() if "tokens_per_expert" not in k
    )
    with torch.no_grad():
        assert torch.equal(loaded.model_parts[0](tokens), ours)


@pytest.mark.parametrize("name", ["qwen3"])
def test_generate_on_an_export_without_titan_s_copy_of_the_bias_warns_in_one_line(
    tmp_path, small_config, one_rank, caplog, name
):
    config = small_config(tmp_path / "run", *_model(name), *EXPORT, "--checkpoint.hf_export_lossy")
    Trainer(resolve(config, 1, "cpu"), one_rank).train()
    export = tmp_path / "run" / "checkpoint" / "step-4"
    # The same folder as a Hugging Face tool writes it back: the files its weight_map names, not Titan's own.
    stripped = tmp_path / "stripped"
    shutil.copytree(
        export, stripped, ignore=shutil.ignore_patterns("*.distcp", ".metadata", TITAN_STATE_FILE)
    )
    index = json.loads((stripped / "model.safetensors.index.json").read_text())
    assert not any(
        k.startswith("titan.") for k in index["weight_map"]
    )  # transformers and vLLM never see them
    del index[TITAN_WEIGHT_MAP]
    (stripped / "model.safetensors.index.json").write_text(json.dumps(index))

    for folder, warned in ((export, False), (stripped, True)):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            loaded = load_checkpoint_model(small_config(tmp_path, *_model(name)), folder, weights="hf")
        lines = [r.getMessage() for r in caplog.records if "holds no Titan copy" in r.getMessage()]
        assert len(lines) == int(warned), folder
        biases = [v for k, v in loaded.model.state_dict().items() if k.endswith("moe.expert_bias")]
        assert all(b.abs().max().item() > 0 for b in biases) != warned
