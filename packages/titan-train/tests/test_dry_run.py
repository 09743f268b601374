"""Dry runs: a layout for 64 or 512 GPUs checked and sized on this CPU machine, in seconds."""

import logging
import re
from pathlib import Path

import pytest
import torch.distributed as dist

from titan_train.cli import run
from titan_train.config import load_job_config
from titan_train.errors import ConfigError
from titan_train.registry import get_model_family
from titan_train.reporting.dry_run import dry_run

FIXTURES = Path(__file__).parent / "fixtures"
GIB = 2**30


@pytest.fixture(autouse=True)
def _info_logs(caplog):
    caplog.set_level(logging.INFO, logger="titan_train.reporting.dry_run")


def _logged(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.name == "titan_train.reporting.dry_run")


def test_torchtitan_llama3_8b_for_64_gpus(caplog):
    # How fast is bench/RESULTS.md's claim, not this test's: a shared machine is slower.
    config_file = str(FIXTURES / "torchtitan_0.2_llama3_8b.toml")
    assert run(["dry-run", "--ngpu", "64", "--job.config_file", config_file]) == 0
    text = _logged(caplog)
    assert "llama3 8B on 64 ranks" in text
    assert "mesh: (dp_shard=64)" in text
    assert "parameters: 8,030,261,248" in text
    # Traced memory, its rows against counts made here from the shapes: float32 parameters and AdamW's
    # two moments sharded 64 ways; at the peak (the loss's backward) the bfloat16 output projection
    # (vocab x dim) gathered, and its gradient before the reduce-scatter.
    params, vocab, dim = 8_030_261_248, 128_256, 4096
    rows = {name: float(gib) for name, gib in re.findall(r"^ +(\S[a-z ,]+?) +([\d.]+) GiB$", text, re.M)}
    assert rows["parameters"] == round(params * 4 / 64 / GIB, 2)
    assert rows["optimizer state"] == round(2 * params * 4 / 64 / GIB, 2)
    assert rows["gathered parameters"] == round(2 * vocab * dim * 2 / GIB, 2)
    parts = (
        "parameters",
        "gathered parameters",
        "optimizer state",
        "activations",
        "loss and logits",
        "other",
    )
    assert sum(rows[p] for p in parts) == pytest.approx(rows["peak allocated"], abs=0.03)  # rounded rows
    reserved = rows["expected peak reserved, expandable segments"]
    assert reserved >= rows["peak allocated"]
    h100, headroom = map(
        float, re.search(r"headroom on H100 \(([\d.]+) GiB\): \+([\d.]+) GiB", text).groups()
    )
    assert headroom == pytest.approx(h100 - reserved, abs=0.015)
    # The tokenizer is not needed to size the job, but training will need it: said, not hidden.
    assert "model.hf_assets_path ./assets/hf/Llama-3.1-8B does not exist here" in text
    assert not dist.is_initialized()


@pytest.mark.slow
def test_llama3_405b_for_512_gpus_with_each_kind_of_pipeline_rank_traced(caplog):
    """The 405B preset (FSDP 8 x TP 8 x PP 8, interleaved 1F1B over 16 micro-batches) checked and its memory
    traced for the first, second and last pipeline rank. How fast is bench/RESULTS.md's claim (about 30 s
    on this CPU at load 2), not this test's: a loaded machine is slower."""
    assert run(["dry-run", "--ngpu", "512", "--job.config_file", "apps/configs/llama3_405b.toml"]) == 0
    text = _logged(caplog)
    assert "mesh: (pp=8, dp_shard=8, tp=8)" in text
    assert "parameters: 405,853,388,800" in text
    for rank in ("rank 0 (pp stage 0)", "rank 64 (pp stage 1)", "rank 448 (pp stage 7)"):
        assert f"{rank}: peak allocated" in text
    assert not dist.is_initialized()


def test_pipeline_and_tensor_parallel_memory_is_traced_for_each_kind_of_stage(caplog):
    flags = [
        "--job.config_file",
        "apps/configs/debug_model.toml",
        "--parallelism.tensor_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--training.seq_len",
        "256",
        "--training.local_batch_size",
        "2",
    ]
    report = dry_run(load_job_config(flags), 8)
    assert report.mesh.startswith("(pp=2, dp_shard=2, tp=2)")
    assert [(r.rank, r.pp_rank) for r in report.memory.ranks] == [(0, 0), (4, 1)]
    first, last = report.memory.ranks
    assert first.allocated != last.allocated  # the embedding's stage and the output's stage differ
    assert "rank 4 (pp stage 1): peak allocated" in _logged(caplog)


def test_expert_parallel_layout_is_named_and_its_memory_traced(caplog):
    """A mixture-of-experts model at ep 4 over FSDP 8: the expert mesh is named and a step is traced (the
    experts' dispatch on fake tensors, whose routing is taken as balanced)."""
    flags = [
        "--job.config_file",
        "apps/configs/qwen3_moe_debug.toml",
        "--parallelism.expert_parallel_degree",
        "4",
        "--activation_checkpoint.mode",
        "full",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "1",
    ]
    report = dry_run(load_job_config(flags), 8)
    assert report.mesh.startswith("(dp_shard=8)") and "experts: ep=4, etp=1, efsdp=2" in report.mesh
    assert "rank 0 (pp stage 0): peak allocated" in _logged(caplog)


@pytest.mark.slow
def test_pipeline_expert_parallel_and_fsdp_memory_of_a_block_causal_moe_is_traced_per_stage(caplog):
    """DeepSeek-V3's layout in small (pp 2 x FSDP 2, ep 2, per-op checkpointing, block-causal flex attention):
    the second stage, which has no token embedding, is given the batch's document ids and is traced."""
    flags = [
        "--job.config_file",
        "apps/configs/deepseek_v3_debug.toml",
        "--model.flavor",
        "debugmodel_flex_attn",
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_schedule",
        "1F1B",
        "--parallelism.expert_parallel_degree",
        "2",
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "op",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
    ]
    report = dry_run(load_job_config(flags), 4)
    assert report.mesh.startswith("(pp=2, dp_shard=2)") and "experts: ep=2, etp=1, efsdp=1" in report.mesh
    assert [(r.rank, r.pp_rank) for r in report.memory.ranks] == [(0, 0), (2, 1)]
    assert "rank 2 (pp stage 1): peak allocated" in _logged(caplog)


def test_a_pipeline_traced_whole_has_the_stages_the_model_has():
    """The debug model's 6 blocks on 4 pipeline stages are 1, 2, 2 and 1 blocks (the embedding and the head
    count as one each): the first stage's trace holds the embedding and one block, as training will, not
    the two of a model rounded up to 2 blocks a stage."""
    flags = [
        "--job.config_file",
        "apps/configs/debug_model.toml",
        "--parallelism.pipeline_parallel_degree",
        "4",
        "--parallelism.pipeline_parallel_schedule",
        "1F1B",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "4",
    ]
    report = dry_run(load_job_config(flags), 4)
    first, p = report.memory.ranks[0], report.params
    assert first.pp_rank == 0
    assert first.breakdown["parameters"] == 4 * (p.embedding + p.per_block)  # float32: no FSDP casts them


def test_the_world_size_of_a_fake_backend_run_comes_from_ngpu(monkeypatch, caplog):
    monkeypatch.setenv("NGPU", "16")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    flags = [
        "--comm.mode",
        "fake_backend",
        "--model.flavor",
        "70B",
        "--parallelism.tensor_parallel_degree",
        "8",
    ]
    assert run(flags) == 0
    assert "mesh: (dp_shard=2, tp=8)" in _logged(caplog)


def test_every_problem_of_a_bad_layout_is_listed_at_once():
    flags = [
        "--model.flavor",
        "8B",
        "--parallelism.tensor_parallel_degree",
        "3",
        "--training.global_batch_size",
        "100",
        "--training.local_batch_size",
        "2",
    ]
    with pytest.raises(ConfigError) as err:
        dry_run(load_job_config(flags), 24)
    message = str(err.value)
    assert "tp(3) does not divide the model's n_heads (32)" in message
    assert "training.global_batch_size (100) must be a multiple" in message
    assert not dist.is_initialized()


def test_a_world_size_the_degrees_do_not_divide_is_refused():
    assert run(["dry-run", "--ngpu", "12", "--parallelism.tensor_parallel_degree", "8"]) == 2


def test_a_vllm_server_the_run_starts_is_counted_on_the_gpu_it_shares(caplog):
    """GRPO with vLLM rollouts started by the run: the server claims grpo.vllm_gpu_memory_utilization of
    rank 0's GPU, so the headroom there is the device less that share less rank 0's expected peak; a server
    at a URL (GPUs of its own) is not counted. Planted: the share left out fails the first assertion."""
    if not (Path("apps/vllm/.venv/bin/python").is_file()):
        pytest.skip("the apps/vllm environment is not installed (uv sync --project apps/vllm --locked)")
    base = [
        "dry-run",
        "--ngpu",
        "2",
        "--job.config_file",
        "apps/configs/debug_grpo.toml",
        "--grpo.engine",
        "vllm",
    ]
    assert run([*base, "--grpo.vllm_gpu_memory_utilization", "0.3"]) == 0
    text = _logged(caplog)
    cap = float(re.search(r"headroom on H100 \(([\d.]+) GiB\)", text).group(1))
    reserved = float(re.search(r"rank 0 \(pp stage 0\):.*expected peak reserved ([\d.]+) GiB", text).group(1))
    share, left = map(
        float,
        re.search(
            r"rank 0's GPU also holds the vLLM server .*\(([\d.]+) GiB.*: \+([\d.]+) GiB", text
        ).groups(),
    )
    assert share == pytest.approx(0.3 * cap, abs=0.01)
    assert left == pytest.approx(cap - share - reserved, abs=0.02)
    caplog.clear()
    assert run([*base, "--grpo.vllm_url", "http://127.0.0.1:8000"]) == 0
    assert "vLLM server" not in _logged(caplog)


@pytest.mark.parametrize(
    ("family", "layout", "nbytes"),
    [("llama3", (), 2), ("deepseek_v3", (), 2), ("llama3", ("--parallelism.tensor_parallel_degree", "2"), 4)],
    ids=["llama3-fsdp", "deepseek_v3-fsdp", "llama3-tp"],
)
def test_the_titan_engines_rollouts_are_counted_beside_what_training_keeps(caplog, family, layout, nbytes):
    """GRPO with the titan engine on 2 ranks: generation adds the whole model (FSDP's shards gathered in its
    bfloat16; under TP an unparallelised float32 copy) and the KV cache of local_batch_size completions of
    max_prompt_length + max_completion_length slots, in the same dtype. The
    cache is checked against the published cache layouts written here (keys and values per kv head for
    Llama; MLA's latent and its rope key for DeepSeek-V3), with the cache's slot bookkeeping (validity,
    position and document id per slot). Planted: the cache counted in float32 failed both cases."""
    argv = ["--job.config_file", "apps/configs/debug_grpo.toml", "--model.name", family, *layout]
    config = load_job_config(argv)
    report = dry_run(config, 2)
    g, batch = config.grpo, config.training.local_batch_size
    slots = g.max_prompt_length + g.max_completion_length
    args = get_model_family(family).flavors["debugmodel"]
    if family == "llama3":
        per_token = 2 * args.kv_heads * (args.dim // args.n_heads)
    else:
        per_token = args.kv_lora_rank + args.qk_rope_head_dim
    bookkeeping = batch * slots * (1 + 8 + 8)  # bool valid, int64 position and document id
    r = report.rollouts
    assert r.kv_cache == args.n_layers * batch * slots * per_token * nbytes + bookkeeping
    assert r.whole_weights == report.params.total * nbytes
    assert "rollouts (titan engine), per rank" in _logged(caplog)
    vllm = load_job_config([*argv, "--grpo.engine", "vllm", "--grpo.vllm_url", "http://127.0.0.1:8000"])
    assert dry_run(vllm, 2).rollouts is None


def test_under_expert_parallelism_the_titan_engine_gathers_only_this_ranks_experts(caplog):
    """GRPO with the titan engine under EP 2: generation decodes on the policy itself, its experts left split
    over the ep ranks (rollouts.lockstep), so each rank gathers the dense weights whole and half the experts,
    in FSDP's bfloat16: Qwen3's MoE (every layer: num_experts SwiGLU experts of 3 dim x moe_inter_dim
    weights) counted here from its published shape. Planted: the experts counted whole failed it."""
    argv = ["--job.config_file", "apps/configs/debug_grpo.toml", "--model.name", "qwen3"]
    argv += ["--model.flavor", "debugmodel_moe", "--parallelism.expert_parallel_degree", "2"]
    report = dry_run(load_job_config(argv), 2)
    args = get_model_family("qwen3").flavors["debugmodel_moe"]
    experts = args.n_layers * args.moe_args.num_experts * 3 * args.dim * args.moe_inter_dim
    assert report.rollouts.whole_weights == (report.params.total - experts // 2) * 2
    assert "rollouts (titan engine), per rank: the model gathered" in _logged(caplog)
