"""One resolve step: a fact derived from the config changes in one place and every consumer sees it.

The facts here come from a Hugging Face `config.json` (`model.flavor = from_hf`): its
`num_hidden_layers` (the model's depth) and `max_position_embeddings` (its context). The file is
written twice with different values; the dry run (and the memory trace inside it), `titan-train
check`, the command line's training path and the trainer each follow it. Before the plan, each
re-read the file and re-derived these facts on its own.
"""

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from titan_models import llama3_args, to_hf_config
from titan_models.gpt_oss import gpt_oss_args
from titan_parallel import ParallelConfigError
from titan_train import registry
from titan_train.cli import run
from titan_train.commands.check import check_launch
from titan_train.config import load_job_config
from titan_train.errors import ConfigError
from titan_train.plan import resolve
from titan_train.reporting.dry_run import dry_run
from titan_train.trainer import Trainer
from titan_train.wiring.data import BUNDLED_TOKENIZER

SEQ_LEN = 96
# What a from_hf run needs on the command line (one that would not load the folder's weights is refused
# first); these folders hold no weights: the trainer test below builds its model without a checkpointer.
LOAD = ("--checkpoint.enable", "--checkpoint.initial_load_in_hf")


def _hf_folder(folder, *, layers: int, context: int):
    """A Hugging Face folder whose config.json states `layers` blocks and a `context`-token context."""
    folder.mkdir(parents=True, exist_ok=True)
    args = replace(llama3_args("debugmodel"), dim=64, n_heads=4, n_layers=layers)
    config = {**to_hf_config(args), "max_position_embeddings": context}
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_TOKENIZER / name, folder / name)
    return folder


def _argv(folder, dump, *more):
    return [
        "--model.flavor",
        "from_hf",
        "--model.hf_assets_path",
        str(folder),
        "--job.dump_folder",
        str(dump),
        "--training.seq_len",
        str(SEQ_LEN),
        "--training.local_batch_size",
        "1",
        "--training.steps",
        "1",
        "--activation_checkpoint.mode",
        "none",
        "--metrics.log_freq",
        "1",
        *more,
    ]


def test_check_dry_run_and_the_command_line_follow_config_json_s_context_and_depth(tmp_path):
    folder = _hf_folder(tmp_path / "hf", layers=2, context=64)
    config = load_job_config(_argv(folder, tmp_path / "run", *LOAD))
    expected = f"training.seq_len = {SEQ_LEN} is beyond the 64-token context"
    with pytest.raises(ConfigError, match=expected):
        check_launch(config, 1)
    with pytest.raises(ConfigError, match=expected):
        dry_run(config, 1)
    assert run(_argv(folder, tmp_path / "run", *LOAD)) == 2  # training stops before it joins a group
    for layers in (2, 3):  # the same run, the file changed: all of them go on, at its depth
        _hf_folder(folder, layers=layers, context=128)
        assert check_launch(config, 1).params.n_blocks == layers
        report = dry_run(config, 1)  # its memory estimate traces one step of each distinct rank
        assert (report.params.n_blocks, report.memory.blocks_per_stage) == (layers, layers)


def test_the_trainer_builds_the_depth_config_json_states(tmp_path, one_rank):
    for layers in (2, 3):
        folder = _hf_folder(tmp_path / f"hf{layers}", layers=layers, context=128)
        trainer = Trainer(
            resolve(load_job_config(_argv(folder, tmp_path / f"run{layers}")), 1, "cpu"), one_rank
        )
        assert len(trainer.model_parts[0].parallel_blocks()) == layers
        trainer.train()


def test_torchtitan_s_llama4_layout_etp_equal_to_tp_without_ep_splits_the_experts_over_tp():
    """torchtitan 0.2.2's llama4_17bx16e.toml sets etp = tp = 8 with ep = 1: accepted as the layout it is
    there (experts split over tp, etp = 1); an etp that is neither 1 nor tp is still refused."""
    toml = str(Path(__file__).parents[3] / "apps" / "configs" / "llama4_17bx16e.toml")
    config = load_job_config(["--job.config_file", toml])
    assert (config.parallelism.expert_parallel_degree, config.parallelism.expert_tensor_parallel_degree) == (
        1,
        8,
    )
    dims = resolve(config, 64, "cuda").dims
    assert (dims.tp, dims.ep, dims.etp) == (8, 1, 1)
    config = load_job_config(["--job.config_file", toml, "--parallelism.expert_tensor_parallel_degree", "2"])
    with pytest.raises(ParallelConfigError, match=r"expert_tensor_parallel_degree\(2\) must be 1 or tp\(8\)"):
        resolve(config, 64, "cuda")


def test_every_registered_family_pickles():
    """A run plan holds its family; the dry run sends the plan to child processes to trace pipeline ranks."""
    import pickle

    from titan_train.registry import get_model_family, model_family_names

    for name in model_family_names():
        assert pickle.loads(pickle.dumps(get_model_family(name))).name == name


def test_gpt_oss_context_parallelism_refuses_alltoall_and_block_causal_in_one_line(tmp_path, monkeypatch):
    """gpt-oss gathers keys and values under CP (allgather only), and its document ids would be counted on
    each rank's slice; causal gpt-oss with allgather is accepted."""
    monkeypatch.setitem(registry._FAMILIES, "gpt_oss", registry.get_model_family("gpt_oss"))  # restored after
    registry.register_flavor(
        "gpt_oss",
        "debugmodel_block_causal",
        replace(gpt_oss_args("debugmodel"), attn_mask_type="block_causal"),
    )
    cp = ["--model.name", "gpt_oss", "--training.seq_len", "64", "--job.dump_folder", str(tmp_path)]
    cp += ["--parallelism.context_parallel_degree", "2"]
    alltoall = ["--model.flavor", "debugmodel", "--parallelism.context_parallel_rotate_method", "alltoall"]
    for flags, words in (
        (alltoall, "context_parallel_rotate_method = 'alltoall': gpt_oss debugmodel gathers"),
        (["--model.flavor", "debugmodel_block_causal"], "with attn_mask_type 'block_causal'"),
    ):
        with pytest.raises(ConfigError) as refused:
            resolve(load_job_config([*cp, *flags]), 2, "cpu")
        assert words in str(refused.value) and "\n" not in str(refused.value), str(refused.value)
    assert resolve(load_job_config([*cp, "--model.flavor", "debugmodel"]), 2, "cpu").dims.cp == 2


def test_a_family_refuses_context_parallelism_through_its_args_and_the_plan_names_the_flavor():
    """Llama 4's published attention tunes its temperature by global position: its args' typed
    `context_parallel_refusal` (titan_train.family_args) refuses cp > 1 at the resolve step. The iRoPE flavor
    without it packs documents in chunked masks of its own, which a row dealt to the ranks cannot carry: refused
    for that; the causal flavor is accepted. Planted once (2026-12-02): the refusal returning None lets cp 2
    through."""
    toml = str(Path(__file__).parents[3] / "apps" / "configs" / "llama4_17bx16e.toml")
    cp2 = ["--job.config_file", toml, "--parallelism.context_parallel_degree", "2"]
    config = load_job_config([*cp2, "--model.flavor", "17bx16e_published"])
    with pytest.raises(
        ConfigError, match=r"context_parallel_degree\(2\): llama4 17bx16e_published tunes its attention"
    ):
        resolve(config, 128, "cuda")
    with pytest.raises(
        ConfigError, match=r"over packed documents: llama4 17bx16e_irope builds its own attention"
    ):
        resolve(load_job_config([*cp2, "--model.flavor", "17bx16e_irope"]), 128, "cuda")
    assert resolve(load_job_config([*cp2, "--model.flavor", "17bx16e"]), 128, "cuda").dims.cp == 2
