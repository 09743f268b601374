"""The mixture-of-experts families through titan-train: they train, log expert load, move their expert
biases as the load-balancing rule says, and bad MoE input stops the run with one line and exit 2."""

import json
import logging
from dataclasses import replace
from itertools import islice

import pytest
import torch

from titan_models import deepseek_v3, llama4, qwen3
from titan_models.moe import MoEArgs
from titan_train.cli import run
from titan_train.commands.checkpoint_model import load_checkpoint_model
from titan_train.config import load_job_config
from titan_train.plan import resolve
from titan_train.registry import get_model_family, register_flavor
from titan_train.trainer import Trainer
from titan_train.wiring.data import build_loader

TINY = "tiny_test"
_TINY_FLAVORS = {
    # DeepSeek with the sequence-wise aux loss on, so its metric is exercised too.
    "deepseek_v3": replace(
        deepseek_v3.DEEPSEEK_V3_FLAVORS["debugmodel"],
        dim=64,
        n_layers=2,
        n_heads=4,
        inter_dim=128,
        moe_inter_dim=64,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        moe_args=MoEArgs(
            num_experts=4, num_shared_experts=1, top_k=2, score_before_experts=False, seq_aux_loss_coeff=1e-2
        ),
    ),
    "qwen3": replace(
        qwen3.QWEN3_FLAVORS["debugmodel_moe"],
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        moe_inter_dim=64,
        moe_args=qwen3.qwen3_moe_args(8, 2),
    ),
    "llama4": replace(llama4.LLAMA4_FLAVORS["debugmodel"], dim=64, n_layers=2, n_heads=4),
}
for _family, _args in _TINY_FLAVORS.items():
    register_flavor(_family, TINY, _args)

SMALL = (
    "--model.flavor",
    TINY,
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--training.steps",
    "6",
    "--activation_checkpoint.mode",
    "none",
    "--metrics.log_freq",
    "1",
    "--metrics.disable_color_printing",
    "--lr_scheduler.warmup_steps",
    "2",
    "--optimizer.lr",
    "1e-2",
    "--compile.enable",
    "false",
)


def _records(dump):
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_each_moe_family_trains_and_logs_expert_load(tmp_path):
    for family, args in _TINY_FLAVORS.items():
        dump = tmp_path / family
        # Two micro-batches per step: the counts cover both (global batch 4 = 2 x local batch 2).
        code = run(
            [
                "--model.name",
                family,
                *SMALL,
                "--training.global_batch_size",
                "4",
                "--job.dump_folder",
                str(dump),
                "--checkpoint.enable",
                "--checkpoint.interval",
                "5",
            ]
        )
        assert code == 0, family
        records = _records(dump)
        _checkpoint_evaluates_as_training_went_on(family, dump, records[-1]["loss"])
        assert len(records) == 6
        assert records[-1]["loss"] < records[0]["loss"] - 0.2, family
        with torch.device("meta"):
            layers = get_model_family(family).build(args).moe_layers()
        for r in records:
            assert set(r["expert_counts"]) == set(layers) == set(r["expert_load"]), family
            for layer, counts in r["expert_counts"].items():
                # Every token of both micro-batches is routed to top_k experts.
                assert sum(counts) == 2 * 2 * 32 * layers[layer].args.top_k
                load = r["expert_load"][layer]
                assert load["max"] == max(counts) and load["max_over_mean"] >= 1.0
        assert ("aux_loss" in records[0]) == (args.moe_args.seq_aux_loss_coeff > 0), family


def _checkpoint_evaluates_as_training_went_on(family: str, dump, last_loss: float) -> None:
    """The step-5 checkpoint, loaded in one process, gives step 6's logged loss on step 6's two
    micro-batches (the 11th and 12th of the training stream), and `titan-train eval` over those 12
    batches reports their mean: the MoE routing, expert weights and biases all come back from the save."""
    flags = ["--model.name", family, *SMALL, "--job.dump_folder", str(dump)]
    loaded = load_checkpoint_model(load_job_config(flags), dump / "checkpoint" / "step-5", device="cpu")
    loss_fn = get_model_family(family).loss_fn
    with torch.no_grad():
        losses = [
            loss_fn(loaded.model(inputs), labels).item()
            for inputs, labels, *_ in islice(build_loader(load_job_config(flags), loaded.tokenizer, 0, 1), 12)
        ]
    assert sum(losses[10:]) / 2 == pytest.approx(last_loss, rel=2e-6), family
    validation = [
        "--validation.seq_len",
        "32",
        "--validation.local_batch_size",
        "2",
        "--validation.steps",
        "12",
    ]
    eval_flags = ["eval", "--checkpoint", str(dump / "checkpoint" / "step-5"), "--device", "cpu"]
    assert run([*eval_flags, *flags, "--validation.dataset", "c4_test", *validation]) == 0, family
    record = json.loads((dump / "eval" / "step-5.json").read_text())
    assert record["perplexity"]["loss"] == pytest.approx(sum(losses) / 12, rel=1e-5), family


@pytest.mark.slow
def test_force_load_balance_routes_evenly_and_is_refused_for_dense_models(tmp_path, caplog):
    code = run(
        [
            "--model.name",
            "qwen3",
            *SMALL,
            "--training.steps",
            "1",
            "--debug.moe_force_load_balance",
            "--job.dump_folder",
            str(tmp_path / "forced"),
        ]
    )
    assert code == 0
    for counts in _records(tmp_path / "forced")[0]["expert_counts"].values():
        assert max(counts) == min(counts)
    caplog.clear()
    code = run(
        [
            "--model.name",
            "qwen3",
            "--model.flavor",
            "debugmodel",
            "--debug.moe_force_load_balance",
            "--job.dump_folder",
            str(tmp_path / "dense"),
        ]
    )
    assert code == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].startswith("debug.moe_force_load_balance = true")


def _hf_config(tmp_path, name, family_module, args, **changes):
    folder = tmp_path / name
    folder.mkdir()
    config = {**family_module.to_hf_config(args), **changes}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# A from_hf model loads the folder's weights (a run that would not is refused first): the shape is refused before.
FROM_HF_LOAD = ("--checkpoint.enable", "--checkpoint.initial_load_in_hf")


@pytest.mark.parametrize(
    "case,field",
    [
        ("unknown_flavor", "model.flavor"),
        ("top_k_above_experts", "moe.top_k"),
        ("groups_not_dividing", "moe.num_expert_groups"),
        ("checkpoint_differs", "moe_intermediate_size"),
    ],
)
def test_bad_moe_input_is_one_line_and_exit_2_before_any_work(tmp_path, caplog, case, field):
    flags = ["--model.name", "qwen3", "--job.dump_folder", str(tmp_path / "out")]
    q, d = _TINY_FLAVORS["qwen3"], _TINY_FLAVORS["deepseek_v3"]
    if case == "unknown_flavor":
        flags += ["--model.flavor", "nope"]
    elif case == "top_k_above_experts":
        folder = _hf_config(tmp_path, case, qwen3, q, num_experts_per_tok=9)
        flags += ["--model.flavor", "from_hf", "--model.hf_assets_path", str(folder), *FROM_HF_LOAD]
    elif case == "groups_not_dividing":
        folder = _hf_config(tmp_path, case, deepseek_v3, d, n_group=3, topk_group=1)
        flags = [
            "--model.name",
            "deepseek_v3",
            "--model.flavor",
            "from_hf",
            "--model.hf_assets_path",
            str(folder),
            "--job.dump_folder",
            str(tmp_path / "out"),
            *FROM_HF_LOAD,
        ]
    else:
        folder = _hf_config(tmp_path, case, qwen3, q, moe_intermediate_size=96)
        flags += [
            "--model.flavor",
            TINY,
            "--checkpoint.enable",
            "--checkpoint.initial_load_in_hf",
            "--checkpoint.initial_load_path",
            str(folder),
        ]
    assert run(flags) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and field in errors[0] and "\n" not in errors[0], errors
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_bias_update_equals_the_rule_applied_to_the_logged_counts(tmp_path, small_config, one_rank):
    # Last in the module: the one-rank group outlives it, and `run` above tears its own group down.
    config = small_config(
        tmp_path, "--model.name", "deepseek_v3", *SMALL, "--training.global_batch_size", "4"
    )
    trainer = Trainer(resolve(config, 1, "cpu"), one_rank)
    layers = trainer.model_parts[0].moe_layers()
    batches = trainer._batches()
    for _ in range(2):  # the second step starts from non-zero biases
        before = {name: m.expert_bias.clone() for name, m in layers.items()}
        step = trainer.train_step(batches)
        for name, moe in layers.items():
            count = torch.tensor(step.moe.counts[name])
            assert count.sum() == 2 * 2 * 32 * moe.args.top_k  # both micro-batches, counted once
            delta = moe.load_balance_coeff * torch.sign(count.mean() - count)
            torch.testing.assert_close(moe.expert_bias, before[name] + delta - delta.mean())
            assert not moe.tokens_per_expert.any()  # reset for the next step
