"""MoE checkpoints torchtitan 0.2.2's trainer wrote, in Titan's trainer: the same logits as torchtitan's,
and a full save resumed with its optimizer, expert bias and step.

`tests/fixtures/torchtitan_moe/` (at the repository root) was written by `make_fixture.py` there: torchtitan's
own trainer trained a tiny deepseek_v3 (MLA, one dense block, two shared experts, the load-balancing
expert bias, YaRN), a tiny qwen3 MoE (QK norm, renormalised routing) and a tiny gpt-oss (attention sinks,
a sliding window on even layers, biased clamped SwiGLU experts, a biased gate, the expert bias, YaRN) for 2 steps and saved them with
its DCP checkpointer (a full save after step 1, a model-only one at step 2); torchtitan's model then
computed logits for fixed tokens with the step-2 weights.
"""

import json
import logging
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from titan_models.deepseek_v3 import DeepSeekV3Args
from titan_models.gpt_oss import GptOssArgs
from titan_models.moe import MoEArgs
from titan_models.qwen3 import Qwen3Args
from titan_train.config import load_job_config
from titan_train.plan import resolve
from titan_train.registry import register_flavor
from titan_train.trainer import Trainer

FIXTURE = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "torchtitan_moe"
FACTS = json.loads((FIXTURE / "facts.json").read_text())
RUN = FACTS["run"]


def _titan_args(model: str):
    """torchtitan's tiny shape as Titan's args: the same field names, except that Titan's qwen3 is MoE
    when it has `moe_args` (torchtitan adds a `moe_enabled` switch)."""
    shape = FACTS["shapes"][model]
    args = {k: v for k, v in shape["args"].items() if k != "moe_enabled"}
    cls = {"deepseek_v3": DeepSeekV3Args, "qwen3": Qwen3Args, "gpt_oss": GptOssArgs}[model]
    return cls(**args, moe_args=MoEArgs(**shape["moe_args"]))


# Under a name of its own: other test files register a `qwen3 tiny_moe` of another shape in the same process.
FLAVOR = f"torchtitan_{FACTS['flavor']}"
MODELS = ("deepseek_v3", "qwen3", "gpt_oss")
for _model in MODELS:
    register_flavor(_model, FLAVOR, _titan_args(_model))


def _trainer(model: str, dump: Path, one_rank, *flags: str) -> Trainer:
    """Titan's trainer for torchtitan's tiny `model`, run as torchtitan's fixture run was."""
    config = load_job_config(
        [
            "--job.dump_folder",
            str(dump),
            "--model.name",
            model,
            "--model.flavor",
            FLAVOR,
            "--training.seq_len",
            str(RUN["seq_len"]),
            "--training.local_batch_size",
            str(RUN["local_batch_size"]),
            "--optimizer.lr",
            str(RUN["lr"]),
            "--lr_scheduler.warmup_steps",
            str(RUN["warmup_steps"]),
            "--metrics.log_freq",
            "1",
            "--checkpoint.enable",
            "true",
            *flags,
        ]
    )
    return Trainer(resolve(config, one_rank.world_size, "cpu"), one_rank)


def _loaded_model(model: str, dump: Path, one_rank) -> torch.nn.Module:
    """Titan's model after its trainer started from torchtitan's checkpoint (`checkpoint.initial_load_path`)."""
    checkpoint = FIXTURE / model / "checkpoint" / f"step-{RUN['steps']}"
    trainer = _trainer(
        model, dump, one_rank, "--training.steps", "0", "--checkpoint.initial_load_path", str(checkpoint)
    )
    trainer.train()
    return trainer.model_parts[0]


@pytest.mark.parametrize("model", MODELS)
def test_a_torchtitan_moe_checkpoint_gives_torchtitans_logits_in_titan(model, tmp_path, one_rank):
    theirs = torch.load(FIXTURE / model / "logits.pt")
    titan = _loaded_model(model, tmp_path, one_rank)
    if model != "gpt_oss":  # gpt-oss's YaRN applies at every length: its table's rows do not depend on it
        assert titan.args.max_seq_len == theirs["max_seq_len"]  # the same rotary table (and YaRN switch)
    biases = [b for name, b in titan.named_buffers() if name.endswith("moe.expert_bias")]
    assert len(biases) == FACTS["shapes"][model]["args"]["n_layers"] - FACTS["shapes"][model]["args"].get(
        "n_dense_layers", 0
    )
    if model != "qwen3":  # torchtitan's load-balancing hook moved the bias; qwen3's optimizer has none
        assert all(b.abs().sum() > 0 for b in biases)
    titan.eval()
    with torch.no_grad():
        # DeepSeek's final norm takes torch's default eps, as torchtitan 0.2.2 builds it (with norm_eps,
        # 1e-5, the logits differed by up to ~4e-5: measured).
        logits = titan(theirs["tokens"])
    assert logits.dtype == theirs["logits"].dtype == torch.float32
    assert (logits - theirs["logits"]).abs().max().item() < 2e-6


@pytest.mark.parametrize("model", MODELS)
def test_a_torchtitan_full_moe_checkpoint_resumes_with_its_optimizer_expert_bias_and_step(
    model, tmp_path, one_rank, caplog
):
    """torchtitan's full save after step 1 resumes in Titan: every weight and buffer it saved (the expert
    bias its balancing hook moved included), AdamW's step and moments for every parameter (the stacked
    experts included), the schedule's position and the step; then training goes on from step 2. The data
    loader's state is torchtitan's own format, started fresh here as Titan's refusal tells a user to."""
    shutil.copytree(FIXTURE / model / "checkpoint" / "step-1", tmp_path / "checkpoint" / "step-1")
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(FIXTURE / model / "checkpoint" / "step-1", f"{tmp}/saved.pt")
        saved = torch.load(f"{tmp}/saved.pt", weights_only=False)
    exclude = ("--checkpoint.exclude_from_loading", "dataloader")
    resumed = _trainer(model, tmp_path, one_rank, "--training.steps", "1", *exclude)
    with caplog.at_level(logging.INFO):
        resumed.train()
    assert "resuming from step-1" in caplog.text and "nothing left to train" in caplog.text
    assert resumed.state.step == 1 and resumed.state.tokens_seen == saved["train_state"]["ntokens_seen"]
    titan = resumed.model_parts[0]
    state = {k: v for k, v in titan.state_dict().items() if k in saved}
    assert state.keys() == {k for k in saved if "." in k and k != "freqs_cis"}
    assert any(k.endswith("moe.expert_bias") for k in state)
    assert max((v - saved[k]).abs().max().item() for k, v in state.items()) == 0.0
    optimizer = resumed.optimizers.optimizers[0]
    differences = [
        (optimizer.state[p][kind] - saved["optimizer"][f"state.{name}.{kind}"]).abs().max().item()
        for name, p in titan.named_parameters()
        for kind in ("step", "exp_avg", "exp_avg_sq")
    ]
    assert len(differences) == 3 * len(list(titan.parameters())) and max(differences) == 0.0
    assert any(".experts." in name for name, _ in titan.named_parameters())  # w1 or gpt-oss's mlp1_weight
    assert resumed.optimizers.schedules[0].last_epoch == saved["lr_scheduler"]["last_epoch"] == 1

    continued = _trainer(model, tmp_path, one_rank, "--training.steps", "2", *exclude)
    continued.train()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2] and continued.state.step == 2
