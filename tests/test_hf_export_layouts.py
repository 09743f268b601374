"""Hugging Face exports written by every rank of FSDP, TP, PP and EP layouts load in transformers as the run.

One torchrun launch (4 ranks, gloo, tests/workers/layout_matrix.py) trains each layout (Llama, Qwen3-MoE
and gpt-oss, whose sinks, biases and transposed experts go through the same per-rank export) 2 steps with
`last_save_in_hf` and a shard size small enough that the ranks write several files. The reference is
the same run's DCP checkpoint, resharded into one process by DCP (another path than the export):
`AutoModelForCausalLM` on the exported folder must give its logits to 1e-5.
"""

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from titan_train.commands.checkpoint_model import load_checkpoint_model
from titan_train.config import load_job_config
from titan_train.registry import get_model_family, register_flavor
from titan_train.torchrun import run_torchrun

sys.path.insert(0, str(Path(__file__).parent / "workers"))
import tiny_moe_flavor  # noqa: E402, F401  (registers qwen3 tiny_moe here too, as the worker does)

pytestmark = pytest.mark.slow

WORKER = Path(__file__).parent / "workers" / "layout_matrix.py"
DEBUG_CONFIG = Path(__file__).parents[1] / "apps" / "configs" / "debug_model.toml"
STEPS = 2
SHARD_BYTES = 300_000  # the 2-layer debug model is about 4.5 MB in fp32: several files per rank
LLAMA = ("--job.config_file", str(DEBUG_CONFIG), "--model.flavor", "debug_2_layers")
MOE = ("--job.config_file", str(DEBUG_CONFIG), "--model.name", "qwen3", "--model.flavor", "tiny_moe")
# gpt-oss cut to 2 layers of 8 experts (tiny_moe_flavor); no expert bias, which GptOssForCausalLM cannot hold.
GPT_OSS = (
    "--job.config_file",
    str(DEBUG_CONFIG),
    "--model.name",
    "gpt_oss",
    "--model.flavor",
    "tiny",
    "--model.moe_load_balance_coeff",
    "0",
    "--checkpoint.hf_max_shard_bytes",  # about 1.3 MB in fp32: several files per rank
    "100000",
)
COMMON = (
    "--metrics.disable_color_printing",
    "--training.steps",
    str(STEPS),
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
    "--optimizer.lr",
    "1e-2",
    "--lr_scheduler.warmup_steps",
    "1",
    "--activation_checkpoint.mode",
    "none",
    "--checkpoint.enable",
    "--checkpoint.interval",
    "100",
    "--checkpoint.last_save_in_hf",
    "--checkpoint.hf_max_shard_bytes",
    str(SHARD_BYTES),
)
P = "--parallelism."
LAYOUTS = {  # name: (model, layout)
    "fsdp4": (LLAMA, (f"{P}data_parallel_shard_degree", "4")),
    "tp2_fsdp2": (LLAMA, (f"{P}data_parallel_shard_degree", "2", f"{P}tensor_parallel_degree", "2")),
    "pp2_fsdp2": (
        LLAMA,
        (
            f"{P}data_parallel_shard_degree",
            "2",
            f"{P}pipeline_parallel_degree",
            "2",
            f"{P}pipeline_parallel_schedule",
            "1F1B",
        ),
    ),
    "ep2_fsdp2": (
        MOE,
        (
            f"{P}data_parallel_shard_degree",
            "4",
            f"{P}expert_parallel_degree",
            "2",
            "--model.moe_load_balance_coeff",  # Qwen3-MoE trains no expert bias unless asked, as torchtitan's
            "1e-3",
            "--checkpoint.hf_export_lossy",
        ),
    ),
    "gpt_oss_tp2_fsdp2": (
        GPT_OSS,
        (f"{P}data_parallel_shard_degree", "2", f"{P}tensor_parallel_degree", "2"),
    ),
    # gpt-oss only where its export differs from the others' (sinks sharded by head under TP, transposed
    # experts under EP), for CI's time; FSDP 4 and PP 2 go through the same per-block path as Llama's.
    "gpt_oss_ep2_fsdp2": (
        GPT_OSS,
        (f"{P}data_parallel_shard_degree", "4", f"{P}expert_parallel_degree", "2"),
    ),
}
register_flavor("llama3", "debug_2_layers", get_model_family("llama3").args_for("debugmodel", n_layers=2))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf_export_layouts")
    (out / "layouts.json").write_text(
        json.dumps({k: [*COMMON, *m, *flags] for k, (m, flags) in LAYOUTS.items()})
    )
    result = run_torchrun(str(WORKER), str(out / "layouts.json"), str(out), nproc=4, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    results = json.loads((out / "results.json").read_text())
    refused = {name: r["refused"] for name, r in results.items() if "refused" in r}
    assert not refused, refused
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_rank_s_export_loads_in_transformers_with_the_run_s_logits(runs, layout):
    step = runs / layout / "checkpoint" / f"step-{STEPS}"
    config = load_job_config(list(LAYOUTS[layout][0]))
    titan = load_checkpoint_model(config, step, device=torch.device("cpu"), weights="dcp", max_seq_len=64)
    assert not titan.hf  # the DCP files, not the export

    index = json.loads((step / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in step.glob("model-*.safetensors"))
    assert sorted(set(index["weight_map"].values())) == shards and len(shards) > 4
    for shard in shards:  # at most SHARD_BYTES of tensors (plus the header), or one larger tensor alone
        names = [k for k, v in index["weight_map"].items() if v == shard]
        assert (step / shard).stat().st_size <= SHARD_BYTES + 4096 or len(names) == 1, shard
    total = sum(t.numel() * t.element_size() for t in titan.model.state_dict().values())
    assert index["metadata"]["total_size"] <= total  # each tensor once (no expert bias, tied head)

    biases = {k: v for k, v in titan.model.state_dict().items() if k.endswith("moe.expert_bias")}
    if layout.startswith("ep"):
        # Qwen3MoeForCausalLM has no expert bias: it computes the trained weights with none.
        assert biases and all(b.abs().max().item() > 0 for b in biases.values())
        with torch.no_grad():
            for bias in biases.values():
                bias.zero_()
    hf = AutoModelForCausalLM.from_pretrained(step, dtype=torch.float32).eval()
    tokens = torch.randint(0, hf.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = titan.model.eval()(tokens)
        theirs = hf(tokens).logits
    assert ours.abs().max().item() > 0.1
    assert (theirs - ours).abs().max().item() <= 1e-5, layout
