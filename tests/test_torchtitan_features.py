"""torchtitan 0.2.2's own integration cases pass through Titan, flags unchanged.

The cases run on torchtitan's integration base config cut for CPU (seq 64, 2 sequences per rank,
Titan's bundled tokenizer), every run of a case on the case's dump folder in order, each on its
number of processes: its feature cases (tests/torchtitan_features/cases.py, from features.py) and
its model cases, the mixture-of-experts families (model_cases.py, from models.py, which torchtitan's
runner launches on the same base config). A case passes when every run trains to its last step (torchtitan's runner asks only that the
command succeeds). The second run of `test_generate` is torchtitan's generation script on the
checkpoint the first run wrote last (`checkpoint/step-10`, with the same config file): here
`titan-train generate` on that folder, with the first run's config and overrides (model, tokenizer),
which must print new tokens.

Two ways to run them:
- `test_every_case_trains`: one torchrun launch per process count runs all the cases of that count
  one after another in the same processes through titan-train's Trainer, as the CLI does
  (tests/workers/layout_matrix.py), so start-up is paid once per count, not once per run. CI runs
  the 9 cases of 2 processes (about 2 minutes on 2 cores); `TITAN_TORCHTITAN_FEATURES=all` runs all
  41 feature and 8 model cases, 4 and 8 processes too (8 ranks share the 2 cores).
- `TITAN_TORCHTITAN_FEATURES=run_train uv run pytest tests/test_torchtitan_features.py -k run_train`:
  each run through `apps/run_train.sh` exactly as torchtitan's runner calls its own script
  (CONFIG_FILE, NGPU, LOG_RANK, --job.dump_folder, then the flags), and torchtitan's own debug
  configs of its MoE families with CONFIG_FILE set to them (`test_moe_debug_config_run_train`); it
  writes each case's seconds to the file named by TITAN_TORCHTITAN_FEATURES_TIMES (default: the
  test's temporary folder). The feature cases took 36 minutes on a 2-core CPU, the model cases and
  debug configs 30 more (bench/RESULTS.md), so not in CI.

The model cases all need 4 or 8 processes, so CI guards them otherwise, in seconds and one process:
`test_model_case_is_accepted_at_its_world_size` checks each as `titan-train check` does before
run_train.sh's torchrun and builds rank 0's model on a fake process group of the case's size, and
`test_moe_debug_config_is_accepted` checks the debug configs.
"""

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(
    0, str(Path(__file__).parent)
)  # tests/ is not a package: the cases' folder is found from here
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torchtitan_features.cases import BASE_CONFIG, ENABLED, GENERATE, REPO  # noqa: E402
from torchtitan_features.model_cases import MODEL_ENABLED  # noqa: E402

from titan_train import cli  # noqa: E402
from titan_train.commands.check import check_launch  # noqa: E402
from titan_train.config import load_job_config  # noqa: E402
from titan_train.reporting.traced_memory import fake_world  # noqa: E402
from titan_train.wiring.model import build_model  # noqa: E402

WORKER = Path(__file__).parent / "workers" / "layout_matrix.py"
FIXTURES = REPO / "packages" / "titan-train" / "tests" / "fixtures"
# torchtitan 0.2.2's own debug configs of its MoE families (each file's keys and values unchanged), with
# the only overrides this CPU needs: torchtitan's sequences (2048-4096 tokens, 4-8 per rank) cut to the
# feature cases' 64 tokens, 2 per rank. Their `hf_assets_path = "./tests/assets/tokenizer"` resolves
# from the repository root (run_train.sh's folder) to tests/assets/tokenizer, a link to Titan's
# bundled test tokenizer.
MOE_DEBUG_CONFIGS = {
    "deepseek_v3": FIXTURES / "torchtitan_0.2_deepseek_v3_debug_model.toml",
    "qwen3": FIXTURES / "torchtitan_0.2_qwen3_moe_debug.toml",
    "llama4": FIXTURES / "torchtitan_0.2_llama4_debug_model.toml",
    "gpt_oss": FIXTURES / "torchtitan_0.2_gpt_oss_debug_model.toml",
}
MOE_DEBUG_CPU_CUT = ["--training.seq_len", "64", "--training.local_batch_size", "2"]
MODE = os.environ.get("TITAN_TORCHTITAN_FEATURES", "ci")
# features.py's cases, then models.py's (all of 4 or 8 processes).
RUNNABLE = [*ENABLED, *MODEL_ENABLED]
# CI runs the 2-process cases (about 2 minutes on 2 cores); "all" adds the 4- and 8-process launches.
IN_THIS_RUN = [case for case in RUNNABLE if MODE == "all" or case.ngpu == 2]
TRAINING_RUNS = [(case, i) for case in IN_THIS_RUN for i, run in enumerate(case.runs) if run != GENERATE]


def _run_train_sh(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """`apps/run_train.sh ARGV` as torchtitan's runner calls its own script (env names CONFIG_FILE, NGPU)."""
    return subprocess.run(
        [str(REPO / "apps" / "run_train.sh"), *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=1800,
    )


def _last_step(dump: Path) -> int:
    lines = (dump / "metrics.jsonl").read_text().splitlines()
    return json.loads(lines[-1])["step"]


def _steps_asked(argv: list[str]) -> int:
    return (
        int(argv[len(argv) - 1 - argv[::-1].index("--training.steps") + 1])
        if "--training.steps" in argv
        else 10
    )


def _generate(train_argv: list[str], dump: Path) -> None:
    """torchtitan's generation step, by `titan-train generate`: the training run's last checkpoint,
    loaded with that run's config and overrides, must give new tokens for torchtitan's prompt. It runs
    through the command's own entry point in this process (a fresh interpreter only imported torch again)."""
    checkpoint = dump / "checkpoint" / f"step-{_steps_asked(train_argv)}"
    argv = [
        "generate",
        "--checkpoint",
        str(checkpoint),
        "--prompt",
        "What is the meaning of life?",
        *train_argv,
    ]
    out = io.StringIO()
    with contextlib.chdir(REPO), contextlib.redirect_stdout(out):
        status = cli.run(argv)
    assert status == 0, "generation: " + out.getvalue()[-4000:]
    generated = re.search(r"generated (\d+) tokens for 1 prompts", out.getvalue())
    assert generated and int(generated[1]) > 0, out.getvalue()[-2000:]


@pytest.fixture(scope="module")
def amortised(tmp_path_factory):
    """Every case's runs, one torchrun per process count; returns {run name: worker result}."""
    out = tmp_path_factory.mktemp("torchtitan_features")
    results = {}
    for nproc in sorted({case.ngpu for case, _ in TRAINING_RUNS}):
        runs = {
            f"{case.name}#{i}": {
                "argv": ["--job.config_file", str(BASE_CONFIG), *case.argv(i, out)],
                "dump": str(out / case.name),
            }
            for case, i in TRAINING_RUNS
            if case.ngpu == nproc
        }
        folder = out / f"ranks_{nproc}"
        folder.mkdir()
        (folder / "runs.json").write_text(json.dumps(runs))
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--rdzv_backend=c10d",
            "--rdzv_endpoint=localhost:0",
            str(WORKER),
            str(folder / "runs.json"),
            str(folder),
        ]
        # Inductor's caches would hand a later run code compiled for an earlier run's process groups
        # (destroyed by then), by name: "Could not resolve the process group registered under the name 7".
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "TORCHINDUCTOR_COMPILE_THREADS": "1",
            "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1",
        }
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env, cwd=REPO)
        assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
        for name, value in json.loads((folder / "results.json").read_text()).items():
            results[name] = {**value, "argv": runs[name]["argv"], "dump": Path(runs[name]["dump"])}
    return results


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("case", IN_THIS_RUN, ids=[case.name for case in IN_THIS_RUN])
def test_every_case_trains(amortised, case):
    for i, run in enumerate(case.runs):
        if run == GENERATE:
            trained = amortised[f"{case.name}#{i - 1}"]
            _generate(trained["argv"], trained["dump"])
            continue
        result = amortised[f"{case.name}#{i}"]
        assert "refused" not in result, f"run {i + 1}: {result['refused']}"
        assert _last_step(result["dump"]) == _steps_asked(result["argv"]), f"run {i + 1} stopped early"


@pytest.mark.skipif(
    os.environ.get("TITAN_TORCHTITAN_FEATURES") != "run_train",
    reason="about 36 minutes: see the module docstring",
)
@pytest.mark.parametrize("case", RUNNABLE, ids=[case.name for case in RUNNABLE])
def test_run_train(case, tmp_path):
    """One case through apps/run_train.sh, as torchtitan's runner launches its own."""
    times = Path(os.environ.get("TITAN_TORCHTITAN_FEATURES_TIMES", tmp_path / "times.jsonl"))
    env = {
        **os.environ,
        "CONFIG_FILE": str(BASE_CONFIG),
        "NGPU": str(case.ngpu),
        "LOG_RANK": ",".join(map(str, range(case.ngpu))),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    start = time.perf_counter()
    for i, run in enumerate(case.runs):
        if run == GENERATE:
            _generate(
                ["--job.config_file", str(BASE_CONFIG), *case.argv(i - 1, tmp_path)], tmp_path / case.name
            )
            continue
        argv = case.argv(i, tmp_path)
        result = _run_train_sh(argv, env)
        assert result.returncode == 0, f"run {i + 1}: " + (result.stdout + result.stderr)[-4000:]
        assert _last_step(tmp_path / case.name) == _steps_asked(argv)
    with times.open("a") as f:
        f.write(
            json.dumps(
                {"case": case.name, "ngpu": case.ngpu, "seconds": round(time.perf_counter() - start, 1)}
            )
            + "\n"
        )


def _flag(argv: list[str], name: str, default: int = 1) -> int:
    return int(argv[argv.index(name) + 1]) if name in argv else default


def _built_on_a_fake_world(plan):
    """What rank 0 builds of `plan` before its first step (mesh, model parallelised or cut into stages,
    pipeline schedule), on the meta device in a fake process group of the plan's size: the refusals a
    run meets after `titan-train check`, at start, without the ranks."""
    fake_world(plan.world_size, 0)
    try:
        dims = replace(plan.dims)  # a mesh of this build's own
        dims.build_mesh("cpu")
        return build_model(replace(plan, dims=dims), torch.device("cpu"), eos_id=0, seed=0, materialize=False)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", MODEL_ENABLED, ids=[case.name for case in MODEL_ENABLED])
def test_model_case_is_accepted_at_its_world_size(case, tmp_path):
    """CI's guard on models.py's cases (their training is in the slow modes above), in this process:
    each case's config checked for its process count as `titan-train check` does before run_train.sh's
    torchrun (every field, settings this CPU cannot run, the layout), with the degrees it asks for, and
    rank 0's model built as training builds it."""
    argv = case.argv(0, tmp_path)
    plan = check_launch(
        load_job_config(["--job.config_file", str(BASE_CONFIG), *argv], check_paths=True), case.ngpu
    )
    built = _built_on_a_fake_world(plan)
    assert (built.pipeline is not None) == (plan.dims.pp > 1)
    asked = {
        dim: _flag(argv, f"--parallelism.{field}_degree")
        for dim, field in [
            ("pp", "pipeline_parallel"),
            ("tp", "tensor_parallel"),
            ("ep", "expert_parallel"),
            ("etp", "expert_tensor_parallel"),
        ]
    }
    assert {dim: getattr(plan.dims, dim) for dim in asked} == asked
    assert plan.world_size == case.ngpu


@pytest.mark.parametrize("family", list(MOE_DEBUG_CONFIGS))
def test_moe_debug_config_is_accepted(family, tmp_path):
    """torchtitan's MoE debug config, as run_train.sh checks it (from the repository root, 1 process)."""
    argv = ["--job.config_file", str(MOE_DEBUG_CONFIGS[family]), *MOE_DEBUG_CPU_CUT]
    cwd = Path.cwd()
    os.chdir(REPO)  # the file's tokenizer path is relative to run_train.sh's folder
    try:
        plan = check_launch(load_job_config(argv, check_paths=True), 1)
    finally:
        os.chdir(cwd)
    assert plan.config.model.name == family


@pytest.mark.skipif(
    os.environ.get("TITAN_TORCHTITAN_FEATURES") != "run_train",
    reason="minutes per config: see the module docstring",
)
@pytest.mark.parametrize("family", list(MOE_DEBUG_CONFIGS))
def test_moe_debug_config_run_train(family, tmp_path):
    """torchtitan's MoE debug config through apps/run_train.sh (CONFIG_FILE=it, 1 process) to its last step."""
    times = Path(os.environ.get("TITAN_TORCHTITAN_FEATURES_TIMES", tmp_path / "times.jsonl"))
    env = {
        **os.environ,
        "CONFIG_FILE": str(MOE_DEBUG_CONFIGS[family]),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    argv = ["--job.dump_folder", str(tmp_path / family), *MOE_DEBUG_CPU_CUT]
    start = time.perf_counter()
    result = _run_train_sh(argv, env)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert _last_step(tmp_path / family) == 10
    with times.open("a") as f:
        f.write(
            json.dumps({"config": family, "ngpu": 1, "seconds": round(time.perf_counter() - start, 1)}) + "\n"
        )
