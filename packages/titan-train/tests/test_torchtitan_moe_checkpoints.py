"""MoE checkpoints torchtitan 0.2.2's trainer wrote, loaded by Titan's trainer: the same logits as torchtitan's.

`tests/fixtures/torchtitan_moe/` (at the repository root) was written by `make_fixture.py` there: torchtitan's
own trainer trained a tiny deepseek_v3 (MLA, one dense block, two shared experts, the load-balancing
expert bias, YaRN) and a tiny qwen3 MoE (QK norm, renormalised routing) for 2 steps and saved them with
its DCP checkpointer; torchtitan's model then computed logits for fixed tokens with those weights.
"""

import json
from pathlib import Path

import pytest
import torch

from titan_models.deepseek_v3 import DeepSeekV3Args
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
    cls = {"deepseek_v3": DeepSeekV3Args, "qwen3": Qwen3Args}[model]
    return cls(**args, moe_args=MoEArgs(**shape["moe_args"]))


for _model in ("deepseek_v3", "qwen3"):
    register_flavor(_model, FACTS["flavor"], _titan_args(_model))


def _loaded_model(model: str, dump: Path, one_rank) -> torch.nn.Module:
    """Titan's model after its trainer started from torchtitan's checkpoint (`checkpoint.initial_load_path`)."""
    checkpoint = FIXTURE / model / "checkpoint" / f"step-{RUN['steps']}"
    config = load_job_config(
        [
            "--job.dump_folder",
            str(dump),
            "--model.name",
            model,
            "--model.flavor",
            FACTS["flavor"],
            "--training.seq_len",
            str(RUN["seq_len"]),
            "--training.local_batch_size",
            str(RUN["local_batch_size"]),
            "--training.steps",
            "0",
            "--checkpoint.enable",
            "true",
            "--checkpoint.initial_load_path",
            str(checkpoint),
        ]
    )
    trainer = Trainer(resolve(config, one_rank.world_size, "cpu"), one_rank)
    trainer.train()
    return trainer.model_parts[0]


@pytest.mark.parametrize("model", ["deepseek_v3", "qwen3"])
def test_a_torchtitan_moe_checkpoint_gives_torchtitans_logits_in_titan(model, tmp_path, one_rank):
    theirs = torch.load(FIXTURE / model / "logits.pt")
    titan = _loaded_model(model, tmp_path, one_rank)
    assert titan.args.max_seq_len == theirs["max_seq_len"]  # the same rotary table (and YaRN switch)
    biases = [b for name, b in titan.named_buffers() if name.endswith("moe.expert_bias")]
    assert len(biases) == FACTS["shapes"][model]["args"]["n_layers"] - FACTS["shapes"][model]["args"].get(
        "n_dense_layers", 0
    )
    if model == "deepseek_v3":  # torchtitan's load-balancing hook moved the bias; qwen3's optimizer has none
        assert all(b.abs().sum() > 0 for b in biases)
    titan.eval()
    with torch.no_grad():
        # DeepSeek's final norm takes torch's default eps, as torchtitan 0.2.2 builds it (with norm_eps,
        # 1e-5, the logits differed by up to ~4e-5: measured).
        logits = titan(theirs["tokens"])
    assert logits.dtype == theirs["logits"].dtype == torch.float32
    assert (logits - theirs["logits"]).abs().max().item() < 2e-6
