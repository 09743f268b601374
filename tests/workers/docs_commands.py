"""Worker for tests/test_docs_commands.py: runs the docs' shell commands, in order, in one process.

`docs_commands.py PLAN.json RESULTS.json`. PLAN.json holds the steps the test made from the fenced
commands: per step, its kind, argv, environment, expected exit status and the scratch folder of its
page. Each page runs in its own scratch folder, whose top-level entries link to the repository, so
`./outputs` lands there and relative paths work. Python entry points (`titan-train`, `titan-data`,
scripts) run in this interpreter, so torch is imported once. Launch scripts run under bash with
stand-ins for `torchrun`, `python`, `srun` and `scontrol`. The stand-ins record how they were called,
and the recorded `-m titan_train.cli` command is checked for its world size with `titan-train check`
(the launch scripts' own check before torchrun), or run when the world is one rank; a recorded
`dry-run` (DRY_RUN=1) runs as it is. A failure is recorded and the next step runs. RESULTS.json has, per step, the exit
status, the seconds (wall and CPU of this process) and the end of its output.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import logging
import os
import runpy
import shutil
import subprocess
import sys
import time
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
BUNDLED_TOKENIZER = REPO / "packages" / "titan-data" / "src" / "titan_data" / "assets" / "tokenizer"
LINKED = ("apps", "bench", "docs", "packages", "tests", "README.md", "pyproject.toml", "uv.lock")
# Training runs are cut to TEST_STEPS steps unless the command asks for at most MAX_KEPT_STEPS itself (the
# docs show short explicit runs where step numbers matter, as in a resume), and run at a tiny batch shape:
# every code path a command takes (config, data, model, parallelism, checkpoints) runs, in seconds.
TEST_STEPS = "2"
MAX_KEPT_STEPS = 6
TEST_SHAPE = (
    "--training.local_batch_size",
    "1",
    "--training.seq_len",
    "64",
    "--validation.local_batch_size",
    "1",
    "--validation.seq_len",
    "64",
)

STUB = """#!/usr/bin/env bash
# Stand-in for {name}: records the call (tab-separated) for tests/workers/docs_commands.py.
{{ printf '%s' {name}; for a in "$@"; do printf '\\t%s' "$a"; done; printf '\\n'; }} >> "$DOCS_CALLS"
{extra}
"""
STUB_EXTRA = {
    # The SLURM script asks srun for the head node's address before it starts torchrun.
    "srun": 'case " $* " in *" torchrun "*) ;; *) echo 127.0.0.1 ;; esac',
    "scontrol": 'if [ "$1 $2" = "show hostnames" ]; then for i in $(seq 1 "${SLURM_NNODES:-1}"); do '
    'echo "node$i"; done; fi',
}


# What the docs' commands name as the user's own files: the bundled chat and preference files for a user's
# chat and preference data, and a tiny instruct model saved by transformers (tests/fixtures/hf_instruct.py)
# for a model downloaded from the hub.
USER_FILES = {
    "data/train.jsonl": REPO
    / "packages"
    / "titan-data"
    / "src"
    / "titan_data"
    / "assets"
    / "chat_test"
    / "chat_test.jsonl",
    "data/pairs.jsonl": REPO
    / "packages"
    / "titan-data"
    / "src"
    / "titan_data"
    / "assets"
    / "preference_test"
    / "preference_test.jsonl",
    "Llama-3.1-8B-Instruct": None,  # made once per run, in the scratch root
}


def _instruct_folder(root: Path) -> Path:
    folder = root / "_hf_instruct"
    if not folder.exists():
        spec = importlib.util.spec_from_file_location(
            "hf_instruct", REPO / "tests" / "fixtures" / "hf_instruct.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.write_instruct_folder(folder)
    return folder


def scratch(root: Path, key: str) -> Path:
    """The page's folder: the repository's top-level entries linked, the assets the configs name, and
    stand-ins for the user's own files the commands name."""
    folder = root / key
    if not folder.exists():
        folder.mkdir(parents=True)
        for name in LINKED:
            (folder / name).symlink_to(REPO / name)
        for name, target in USER_FILES.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).symlink_to(target or _instruct_folder(root))
        # The real models' configs name the folder `apps/scripts/download_hf_assets.py` fills from the hub;
        # the tokenizer bundled with titan-data stands in for it (the commands here only check the configs).
        for config in sorted((REPO / "apps" / "configs").glob("*.toml")):
            assets = tomllib.loads(config.read_text()).get("model", {}).get("hf_assets_path", "")
            if assets and not Path(assets).is_absolute() and not (folder / assets).exists():
                (folder / assets).parent.mkdir(parents=True, exist_ok=True)
                (folder / assets).symlink_to(BUNDLED_TOKENIZER)
    return folder


def write_stubs(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("torchrun", "python", "srun", "scontrol"):
        path = folder / name
        path.write_text(STUB.format(name=name, extra=STUB_EXTRA.get(name, "")))
        path.chmod(0o755)
    return folder


def is_training(argv: list[str]) -> bool:
    return bool(argv) and argv[0] not in ("dry-run", "report") and not {"--help", "-h"} & set(argv)


def sized_for_test(argv: list[str]) -> list[str]:
    """A training command at TEST_SHAPE and TEST_STEPS, except for the fields it sets itself (a command that
    shows a refused value keeps it; one that asks for at most MAX_KEPT_STEPS steps keeps them)."""
    asked = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--training.steps"]
    steps = [] if asked and int(asked[-1]) <= MAX_KEPT_STEPS else ["--training.steps", TEST_STEPS]
    shape = [pair for pair in zip(TEST_SHAPE[::2], TEST_SHAPE[1::2], strict=True) if pair[0] not in argv]
    # A GRPO config's batch counts completions: one group of num_generations is the smallest.
    files = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--job.config_file"]
    config = tomllib.loads(Path(files[-1]).read_text()) if files and Path(files[-1]).is_file() else {}
    if config.get("training", {}).get("dataset") == "prompts":
        group = str(config.get("grpo", {}).get("num_generations", 8))
        shape = [(k, group if k == "--training.local_batch_size" else v) for k, v in shape]
    return [*argv, *steps, *(token for pair in shape for token in pair)]


def torchrun_world(argv: list[str]) -> tuple[int, list[str]]:
    """(nnodes * nproc_per_node, the titan_train.cli arguments) of a torchrun command line."""
    sizes = {"nnodes": 1, "nproc_per_node": 1}
    i = 0
    while i < len(argv) and argv[i] != "-m":
        name, eq, value = argv[i].lstrip("-").replace("-", "_").partition("=")
        if name in sizes:
            sizes[name] = int((value if eq else argv[i + 1]).split(":")[-1])
        i += 1
    if argv[i : i + 2] != ["-m", "titan_train.cli"]:
        raise ValueError(f"torchrun does not start titan_train.cli: {argv}")
    return sizes["nnodes"] * sizes["nproc_per_node"], argv[i + 2 :]


def titan_argv_for_launch(world: int, argv: list[str]) -> list[str]:
    """What a launch of `world` ranks becomes here: its config and layout checked for that world (every
    field, the degrees, the model against them), or the run itself for one rank."""
    if world == 1:
        return sized_for_test(argv) if is_training(argv) else argv
    return ["check", "--ngpu", str(world), *argv]


@contextlib.contextmanager
def environment(cwd: Path, env: dict[str, str], argv0: str, args: list[str]):
    saved_env, saved_argv, saved_cwd, saved_path = dict(os.environ), sys.argv, os.getcwd(), list(sys.path)
    os.environ.update(env)
    sys.argv = [argv0, *args]
    os.chdir(cwd)
    try:
        yield
    finally:
        os.chdir(saved_cwd)
        sys.argv, sys.path[:] = saved_argv, saved_path
        os.environ.clear()
        os.environ.update(saved_env)


def in_process(fn, cwd: Path, env: dict[str, str], argv0: str, args: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    logging.getLogger().handlers.clear()  # each entry point sets up logging on its own stream
    with environment(cwd, env, argv0, args), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            rc = fn(args)
        except SystemExit as stop:
            rc = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except BaseException as err:  # noqa: BLE001 - a failing command is recorded, not fatal
            import traceback

            traceback.print_exc()
            rc = f"raised {type(err).__name__}: {err}"
    return (0 if rc is None else rc), out.getvalue()


DRY_RUNS: dict[tuple[str, ...], tuple[int, str]] = {}


def titan_train(args: list[str]) -> int:
    from titan_train.cli import main

    return main(args)


def titan_train_step(cwd: Path, env: dict[str, str], args: list[str]) -> tuple[int, str]:
    """`titan-train ARGS` here; a dry run or check (they write nothing) made already is not repeated."""
    key = tuple(args)
    if args[:1] in (["dry-run"], ["check"]) and key in DRY_RUNS:
        rc, output = DRY_RUNS[key]
        return rc, f"(the same as an earlier command)\n{output}"
    result = in_process(titan_train, cwd, env, "titan-train", args)
    if args[:1] in (["dry-run"], ["check"]):
        DRY_RUNS[key] = result
    return result


def titan_data(args: list[str]) -> int:
    from titan_data.cli import main

    return main(args)


def script(path: str):
    def run(args: list[str]) -> int:
        sys.path.insert(0, str(Path(path).resolve().parent))
        runpy.run_path(path, run_name="__main__")
        return 0

    return run


def launch(step: dict, cwd: Path, stubs: Path) -> tuple[int, str]:
    """Run a launch script under the stand-ins, then check what it would have started."""
    calls = cwd / "launch_calls.tsv"
    calls.unlink(missing_ok=True)
    env = {**os.environ, **step["env"], "PATH": f"{stubs}:{os.environ['PATH']}", "DOCS_CALLS": str(calls)}
    done = subprocess.run(step["argv"], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    output = done.stdout + done.stderr
    if done.returncode != 0:
        return done.returncode, output
    recorded = [line.split("\t") for line in calls.read_text().splitlines()] if calls.exists() else []
    torchruns = [call[1:] for call in recorded if call[0] == "torchrun" or call[1:2] == ["torchrun"]]
    torchruns = [call[1:] if call[:1] == ["torchrun"] else call for call in torchruns]
    pythons = [
        call[1:] for call in recorded if call[0] == "python" and call[1:3] == ["-m", "titan_train.cli"]
    ]
    if torchruns:
        world, args = torchrun_world(torchruns[-1])
        args = titan_argv_for_launch(world, args)
    elif pythons:
        args = pythons[-1][2:]
    else:
        return f"the script started no titan_train.cli: calls {recorded}", output
    rc, more = titan_train_step(cwd, step["env"], args)
    return rc, f"{output}\n$ titan-train {' '.join(args)}\n{more}"


def run_step(step: dict, root: Path, stubs: Path) -> tuple[int, str]:
    cwd = scratch(root, step["scratch"])
    kind, argv, env = step["kind"], step["argv"], step["env"]
    if kind == "titan-train":
        return titan_train_step(cwd, env, sized_for_test(argv) if is_training(argv) else argv)
    if kind == "titan-data":
        return in_process(titan_data, cwd, env, "titan-data", argv)
    if kind == "script":
        return in_process(script(argv[0]), cwd, env, argv[0], argv[1:])
    if kind == "torchrun":
        world, args = torchrun_world(argv)
        return titan_train_step(cwd, env, titan_argv_for_launch(world, args))
    if kind == "launch":
        return launch(step, cwd, stubs)
    if kind == "subprocess":
        # `uv pip` acts on this interpreter's environment (with --dry-run it only resolves).
        env = {**os.environ, "VIRTUAL_ENV": sys.prefix, **env}
        done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        return done.returncode, done.stdout + done.stderr
    raise ValueError(f"unknown step kind {kind!r}")


def main() -> int:
    plan, results_path = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    root = results_path.parent / "scratch"
    stubs = write_stubs(results_path.parent / "stubs")
    results = []
    for step in plan:
        start, cpu = time.perf_counter(), time.process_time()
        rc, output = run_step(step, root, stubs)
        results.append(
            {
                "id": step["id"],
                "rc": rc,
                "seconds": round(time.perf_counter() - start, 2),
                "cpu_seconds": round(time.process_time() - cpu, 2),
                "output": output[-3000:],
            }
        )
        results_path.write_text(json.dumps(results, indent=1))
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
