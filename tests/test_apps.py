"""The launch scripts and configs under apps/, run as a user runs them."""

import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from titan_train.cli import run
from titan_train.config import load_job_config
from titan_train.registry import model_family_names

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "apps" / "configs").glob("*.toml"))
PUBLISHED = REPO / "packages/titan-train/tests/published_configs"


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_every_shipped_config_loads_in_the_current_schema_without_warnings(config, caplog):
    c = load_job_config(["--job.config_file", str(config)])
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert c.model.name in model_family_names()
    # Each file is named for its family (torchtitan's names), the llama3 debug model excepted.
    assert config.stem.split("_")[0] in (c.model.name.split("_")[0], "debug"), (config.stem, c.model.name)


def test_shipped_configs_cover_debug_8b_70b_and_405b():
    flavors = {load_job_config(["--job.config_file", str(c)]).model.flavor for c in CONFIGS}
    assert {"debugmodel", "8B", "70B", "405B"} <= flavors


def _dry_run(config: str, ngpu: int) -> str:
    env = {
        **os.environ,
        "DRY_RUN": "1",
        "NGPU": str(ngpu),
        "CONFIG_FILE": config,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    # How fast it prints is a benchmark's claim (bench/RESULTS.md), not this test's: a loaded machine is slower.
    result = subprocess.run(
        [str(REPO / "apps" / "run_train.sh")], capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return result.stdout


@pytest.mark.slow
def test_dry_run_of_the_70b_config_for_256_gpus_through_run_train_sh():
    out = _dry_run("apps/configs/llama3_70b.toml", 256)
    assert "llama3 70B on 256 ranks" in out
    assert "mesh: (dp_shard=32, tp=8)" in out
    assert "parameters: 70,553,706,496" in out
    assert "memory per rank, traced" in out and "scaled to 80" in out


@pytest.mark.slow
def test_a_layout_error_under_run_train_sh_is_one_line_and_exit_status_2_before_torchrun():
    env = {**os.environ, "NGPU": "2", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    result = subprocess.run(
        [str(REPO / "apps" / "run_train.sh"), "--parallelism.tensor_parallel_degree", "3"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert result.returncode == 2, lines
    assert len(lines) == 1, lines  # no rank repeats it, no launcher traceback follows
    assert lines[0].endswith(
        "parallelism: dp_replicate(1) * cp(1) * tp(3) * pp(1) = 3 does not divide WORLD_SIZE 2; choose degrees "
        "whose product divides the number of processes"
    )


def _run_train(env: dict[str, str], *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", **env}
    return subprocess.run(
        [str(REPO / "apps" / "run_train.sh"), *flags], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("backend", "line"),
    [
        (
            "nvshmem",
            "COMM_BACKEND=nvshmem: NVSHMEM needs CUDA GPUs, and this run's device is cpu; unset COMM_BACKEND",
        ),
        (
            "bogus",
            "COMM_BACKEND=bogus is not one of nccl, nvshmem; unset COMM_BACKEND (or set COMM_BACKEND=nccl)",
        ),
    ],
)
def test_a_comm_backend_that_cannot_work_stops_run_train_sh_with_one_line_and_status_2(backend, line):
    result = _run_train({"NGPU": "2", "COMM_BACKEND": backend})
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert result.returncode == 2, lines
    assert len(lines) == 1 and line in lines[0], lines


@pytest.mark.slow
def test_comm_backend_nccl_trains_as_before(tmp_path):
    result = _run_train(
        {"NGPU": "1", "COMM_BACKEND": "nccl", "OMP_NUM_THREADS": "1"},
        "--job.dump_folder",
        str(tmp_path),
        "--training.steps",
        "1",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "1",
        "--metrics.disable_color_printing",
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert (tmp_path / "metrics.jsonl").read_text().count('"step": 1') == 1


def test_slurm_script_is_valid_bash_and_uses_torchrun_c10d_rendezvous():
    script = REPO / "apps" / "multinode_trainer.slurm"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "srun torchrun" in text and "--rdzv_backend c10d" in text and "-m titan_train.cli" in text


def _download_script():
    spec = importlib.util.spec_from_file_location(
        "download_hf_assets", REPO / "apps" / "scripts" / "download_hf_assets.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_download_script_fetches_only_the_asked_assets_with_a_token_from_flag_or_environment(monkeypatch):
    script = _download_script()
    tokenizer_only = script.patterns_for(["tokenizer"])
    assert "original/tokenizer.model" in tokenizer_only and "*.safetensors" not in tokenizer_only
    everything = script.patterns_for(["tokenizer", "config", "safetensors"], ["*.md"])
    assert everything.count("model.safetensors.index.json") == 1 and everything[-1] == "*.md"
    with pytest.raises(ValueError, match="unknown asset kind"):
        script.patterns_for(["weights"])
    monkeypatch.setenv("HF_TOKEN", "from-env")
    assert script.resolve_token(None) == "from-env"
    assert script.resolve_token("from-flag") == "from-flag"
    assert script.target_folder("./assets/hf", "meta-llama/Llama-3.1-8B") == Path("assets/hf/Llama-3.1-8B")


def test_download_script_without_the_hub_says_so(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    cmd = [
        sys.executable,
        str(REPO / "apps" / "scripts" / "download_hf_assets.py"),
        "--repo_id",
        "meta-llama/Llama-3.1-8B",
        "--local_dir",
        str(tmp_path / "assets"),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 1
    assert "cannot reach the Hugging Face hub for meta-llama/Llama-3.1-8B" in result.stderr


def test_the_8b_sft_config_passes_the_start_checks_for_one_node_with_and_without_context_parallelism(
    tmp_path, caplog
):
    """The 8B SFT config as a user launches it (chat data named by its hub id, the checkpoint imported from
    Hugging Face files): `titan-train check --ngpu 8`, which run_train.sh runs before torchrun, passes every
    start-up check, the import's flavor check against the published config.json included, also with
    context parallelism over its packed rows (ptrr); with a rotate method that gathering cannot honour it
    stops in one line naming the reason."""
    assets = tmp_path / "Llama-3.1-8B-Instruct"
    assets.mkdir()
    published = REPO / "packages/titan-train/tests/published_configs/Llama-3.1-8B.json"
    (assets / "config.json").write_text(published.read_text())
    config = ("--job.config_file", str(REPO / "apps/configs/llama3_8b_sft.toml"))
    paths = ("--model.hf_assets_path", str(assets), "--checkpoint.initial_load_path", str(assets))
    assert run(["check", "--ngpu", "8", *config, *paths]) == 0
    c = load_job_config(list(config))
    assert (c.training.dataset, c.training.dataset_path, c.model.flavor) == (
        "chat",
        "HuggingFaceH4/no_robots",
        "8B",
    )
    assert c.checkpoint.initial_load_in_hf and c.checkpoint.last_save_in_hf
    caplog.clear()
    cp = (
        "--parallelism.context_parallel_degree",
        "2",
        "--parallelism.context_parallel_load_balancer",
        "ptrr",
    )
    assert run(["check", "--ngpu", "8", *config, *paths, *cp]) == 0
    alltoall = ("--parallelism.context_parallel_rotate_method", "alltoall")
    assert run(["check", "--ngpu", "8", *config, *paths, *cp, *alltoall]) == 2
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert "context_parallel_rotate_method = 'alltoall'" in line and "over packed documents gathers" in line


@pytest.mark.parametrize(
    ("config", "published", "lora"),
    [
        ("llama3_8b_dpo", "Llama-3.1-8B", False),
        ("llama3_70b_qlora_dpo", "Llama-3.1-70B", True),
        ("qwen3_30b_a3b_dpo", "Qwen3-30B-A3B", False),
    ],
)
def test_the_dpo_configs_start_from_a_hugging_face_folder_and_pass_the_start_checks_on_8_gpus(
    tmp_path, config, published, lora
):
    """The 8B DPO, 70B QLoRA DPO and Qwen3 30B-A3B DPO (EP 8) configs as a user launches them (a preference
    set named by its hub id, the model's shape and weights from a Hugging Face folder: flavor from_hf,
    initial_load_in_hf):
    `titan-train check --ngpu 8` passes every start-up check on a folder holding the published config.json;
    so do the full-weight ones with the other reference (precomputed, or a frozen copy)."""
    assets = tmp_path / published
    assets.mkdir()
    (assets / "config.json").write_text((PUBLISHED / f"{published}.json").read_text())
    flags = ["--job.config_file", str(REPO / "apps/configs" / f"{config}.toml"), "--model.hf_assets_path"]
    flags += [str(assets), "--checkpoint.initial_load_path", str(assets)]
    assert run(["check", "--ngpu", "8", *flags]) == 0
    c = load_job_config(flags)
    assert (c.training.dataset, c.training.dataset_path) == ("preference", "trl-lib/ultrafeedback_binarized")
    assert c.model.flavor == "from_hf" and c.checkpoint.enable and c.checkpoint.initial_load_in_hf
    assert c.parallelism.data_parallel_shard_degree in (-1, 8)
    assert (c.model.converters == ["lora"] and c.lora.quantize_base == "nf4") == lora
    assert c.parallelism.expert_parallel_degree == (8 if c.model.name == "qwen3" else 1)
    if not lora:
        other = "auto" if c.preference.reference == "precompute" else "precompute"
        assert run(["check", "--ngpu", "8", *flags, "--preference.reference", other]) == 0


@pytest.mark.parametrize(
    ("config", "published", "ep"),
    [("qwen3_8b_grpo", "Qwen3-8B", 1), ("qwen3_30b_a3b_grpo", "Qwen3-30B-A3B", 8)],
)
def test_the_grpo_configs_pass_the_start_checks_on_8_gpus_from_a_hugging_face_folder(
    tmp_path, config, published, ep
):
    """The 8-GPU GRPO configs as a user launches them (GSM8K by its hub id and configuration, the weights
    imported from a Hugging Face folder): `titan-train check --ngpu 8` passes every start-up check on a folder
    holding the published config.json, the flavor checked against it; the 30B-A3B one trains under expert
    parallelism 8 against a vLLM server at a URL, the 8B one starts its own (and needs its environment).
    Before prompts rows could be named by a hub id at start, both failed here."""
    assets = tmp_path / published
    assets.mkdir()
    (assets / "config.json").write_text((PUBLISHED / f"{published}.json").read_text())
    flags = ["--job.config_file", str(REPO / "apps/configs" / f"{config}.toml"), "--model.hf_assets_path"]
    flags += [str(assets), "--checkpoint.initial_load_path", str(assets)]
    vllm = REPO / "apps/vllm/.venv/bin/python"
    if config == "qwen3_8b_grpo" and not vllm.is_file():
        pytest.skip("the apps/vllm environment is not installed (uv sync --project apps/vllm --locked)")
    assert run(["check", "--ngpu", "8", *flags]) == 0
    c = load_job_config(flags)
    assert (c.training.dataset, c.training.dataset_path, c.training.dataset_config) == (
        "prompts",
        "openai/gsm8k",
        "main",
    )
    assert c.parallelism.expert_parallel_degree == ep
    assert c.grpo.engine == "vllm" and (c.grpo.vllm_url is None) == (ep == 1)
