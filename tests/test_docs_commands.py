"""The docs cannot rot: every shell command they show runs, and every file, module and link they name exists.

Every fenced `bash`/`sh`/`shell`/`console` block of docs/*.md and README.md is read line by line (a
command in a fence with no language is refused: `test_commands_are_in_shell_fences`), and
each command must match one of the rules below, or `test_every_docs_command_has_a_rule` fails and names
it:

- run in full, in the order of its page, in a scratch folder of that page: `titan-train` (train,
  `report`, `dry-run`, `--help`, a refused config), `titan-data`, `apps/scripts/gen_config_reference.py`
  (with `--check`, so it never rewrites the page), `bench/gpu_throughput.py --table-from`.
  A training command runs with `--training.steps 2` appended (unless it asks for 6 steps or fewer
  itself) and a batch of 1 sequence of 64 tokens, so that it costs seconds and still takes every code
  path its flags choose.
- launched through a stand-in: `apps/run_train.sh` and `sbatch apps/multinode_trainer.slurm` run
  under bash with `torchrun`, `python`, `srun` and `scontrol` replaced by recorders; the recorded
  `-m titan_train.cli` command is then checked for its world size (nnodes x nproc_per_node) with
  `titan-train check --ngpu N` (every field, the degrees, the model against them: what the launch
  scripts run before torchrun), or run in full for one rank; a recorded `dry-run` (`DRY_RUN=1`) runs
  as it is. A `torchrun` command line is checked the same way directly.
- GPU machine (`apps/gpu/run.sh ...`): the script must be valid bash; the command it wraps is checked
  with `titan-train check` (titan-train), `--help`-checked (benchmarks) or checked as a test command
  (pytest).
- benchmarks (`uv run python bench/*.py`): they take minutes, so their arguments are parsed and
  `--help` is printed. So are `titan-train generate` and `eval`, which read the checkpoint of a
  finished run (and eval downloads its tasks).
- network or environment changes: `uv pip install X` and `uv sync ...` run with `--dry-run` (sync also
  `--locked`); `apps/gpu/fetch_wheels.sh` must be valid bash and find its wheel list; `titan-data
  prepare` (a download from the hub) prints its `--help`.
- test commands (`uv run pytest`, with or without paths and markers): the full suite is not re-run
  inside itself; a test command's paths must exist under the configured test paths and its markers
  must be declared.

A trailing `# ... exit status N` comment on a command is checked too: the command must exit with N.
All commands that run share one worker process (tests/workers/docs_commands.py), so torch is
imported once.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_FENCES = {"bash", "sh", "shell", "console"}
WORKER = REPO / "tests" / "workers" / "docs_commands.py"
_spec = importlib.util.spec_from_file_location("docs_commands_worker", WORKER)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)


@dataclass(frozen=True)
class Command:
    page: str  # relative to the repository
    line: int
    text: str
    comment: str
    env: dict[str, str]
    argv: list[str]

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


@dataclass
class Plan:
    """How a command is covered: a step for the worker (kind, argv), or a check run here."""

    kind: str
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    check: Callable[[], None] | None = None

    @property
    def runs(self) -> bool:
        return self.check is None


def _split_comment(line: str) -> tuple[str, str]:
    """(command, comment): the comment starts at the first unquoted ` #`."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].strip(), line[i + 1 :].strip()
    return line.strip(), ""


def fenced_commands(path: Path) -> list[Command]:
    """The commands of every shell block of a Markdown page (backslash continuations joined)."""
    commands, fence, pending, start = [], None, "", 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith(("```", "~~~")):
            if fence is None:
                fence = stripped[3:].strip().split(" ")[0].lower() or "-"
            else:
                fence = None
            continue
        if fence not in SHELL_FENCES:
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        text, comment = _split_comment(pending + stripped)
        pending = ""
        if not text:
            continue
        tokens = shlex.split(text)
        env = {}
        while tokens and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", tokens[0]):
            key, value = tokens.pop(0).split("=", 1)
            env[key] = value
        commands.append(Command(str(path.relative_to(REPO)), start, text, comment, env, tokens))
    return commands


def all_commands() -> list[Command]:
    return [command for page in PAGES for command in fenced_commands(page)]


# Checks made here, without running the command.


def _valid_bash(script: str) -> Callable[[], None]:
    def check() -> None:
        subprocess.run(["bash", "-n", str(REPO / script)], check=True)

    return check


def _test_command(args: list[str]) -> Callable[[], None]:
    """A pytest command: its paths exist under the configured test paths, its markers are declared."""

    def check() -> None:
        settings = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
        markers = {line.split(":")[0] for line in settings["markers"]}
        i = 0
        while i < len(args):
            arg = args[i]
            if arg == "-m":
                names = set(re.findall(r"\w+", args[i + 1])) - {"and", "or", "not"}
                assert names <= markers, f"undeclared pytest markers {names - markers}"
                i += 2
                continue
            if arg in ("-n", "--dist", "-k"):  # options whose value is not a path
                i += 2
                continue
            if not arg.startswith("-"):
                path = REPO / arg.split("::")[0]
                assert path.exists(), f"{arg} does not exist"
                assert any(path.is_relative_to(REPO / root) for root in settings["testpaths"]), (
                    f"{arg} is outside the test paths {settings['testpaths']}"
                )
            i += 1

    return check


def _fetch_wheels() -> None:
    _valid_bash("apps/gpu/fetch_wheels.sh")()
    assert (REPO / "apps" / "gpu" / "wheels.txt").is_file()


def _strip_uv_run(argv: list[str]) -> list[str] | None:
    """The command after `uv run [--package NAME]`, or None when it is not a `uv run` command."""
    if argv[:2] != ["uv", "run"]:
        return None
    rest = argv[2:]
    while rest and rest[0].startswith("--"):
        rest = rest[2:] if rest[0] in ("--package", "--with", "--extra") else rest[1:]
    return rest


def _python(args: list[str], gpu: bool) -> Plan | None:
    """`python ...` (after `uv run`, or on the GPU machine)."""
    if args[:2] == ["-m", "pytest"]:
        return Plan("check", check=_test_command(args[2:]))
    if args[:2] == ["-m", "titan_train.cli"]:
        titan = args[2:]
        return Plan(
            "titan-train", ["check", "--ngpu", "1", *titan] if gpu and worker.is_training(titan) else titan
        )
    if args[:2] == ["-m", "torch.distributed.run"]:
        if not gpu:
            return Plan("torchrun", args[2:])
        world, titan = worker.torchrun_world(args[2:])
        return Plan("titan-train", ["check", "--ngpu", str(world), *titan])
    if not args or not args[0].endswith(".py"):
        return None
    script = args[0]
    if script == "apps/scripts/gen_config_reference.py":
        return Plan("script", [script, *[a for a in args[1:] if a != "--check"], "--check"])
    if script.startswith("bench/"):
        if "--table-from" in args:
            return Plan("script", args)
        return Plan("script", [*args, "--help"])  # benchmarks take minutes: parse the arguments only
    if script == "apps/scripts/download_hf_assets.py":
        return Plan("script", [script, "--help"])  # downloads from the hub
    return None


SBATCH_FLAGS = {"--exclusive", "--requeue", "--no-requeue", "--test-only", "--wait"}


def _sbatch(argv: list[str], env: dict[str, str]) -> Plan | None:
    """`sbatch [options] SCRIPT ARGS`: the script under bash, with the SLURM variables of `--nodes`."""
    args, nodes = argv[1:], None
    while args and args[0].startswith("-"):
        name, eq, value = args.pop(0).partition("=")
        if not eq and name not in SBATCH_FLAGS:
            value = args.pop(0)
        if name in ("--nodes", "-N"):
            nodes = value
    if not args or not (REPO / args[0]).is_file():
        return None
    script = args[0]
    default = re.search(r"#SBATCH --nodes=(\d+)", (REPO / script).read_text())
    nodes = nodes or (default.group(1) if default else "1")
    slurm = {"SLURM_NNODES": nodes, "SLURM_JOB_NODELIST": f"node[1-{nodes}]", "SLURM_JOB_ID": "1"}
    return Plan("launch", ["bash", script, *args[1:]], {**env, **slurm})


def classify(command: Command) -> Plan | None:
    """The rule that covers `command` (see the module docstring), or None."""
    argv, env = command.argv, command.env
    inner = _strip_uv_run(argv)
    if inner is not None:
        if inner[:1] == ["pytest"]:
            return Plan("check", check=_test_command(inner[1:]))
        if inner[:1] == ["python"]:
            return _python(inner[1:], gpu=False)
        argv = inner
    if argv[:1] == ["titan-train"] and argv[1:2] in (["generate"], ["eval"]):
        return Plan(
            "titan-train", [*argv[1:], "--help"], env
        )  # a finished run's checkpoint; eval downloads tasks
    if argv[:1] == ["titan-train"]:
        return Plan("titan-train", argv[1:], env)
    if argv[:2] == ["titan-data", "prepare"]:
        return Plan("titan-data", ["prepare", "--help"], env)  # downloads from the hub
    if argv[:1] == ["titan-data"]:
        return Plan("titan-data", argv[1:], env)
    if argv[:1] == ["torchrun"]:
        return Plan("torchrun", argv[1:], env)
    if argv[:3] == ["uv", "pip", "install"]:
        return Plan("subprocess", [*argv, "--dry-run"], env)
    if argv[:2] == ["uv", "sync"]:
        locked = [] if "--locked" in argv else ["--locked"]
        return Plan("subprocess", [*argv, *locked, "--dry-run"], env)
    if argv[:1] in (["./apps/run_train.sh"], ["apps/run_train.sh"]):
        return Plan("launch", argv, env)
    if argv[:1] == ["sbatch"]:
        return _sbatch(argv, env)
    if argv[:1] == ["apps/gpu/fetch_wheels.sh"]:
        return Plan("check", check=_fetch_wheels)
    if argv[:1] == ["apps/gpu/run.sh"] and argv[1:2] in (["python"], ["python3"]):
        plan = _python(argv[2:], gpu=True)
        if plan is None:
            return None
        if plan.runs:
            return Plan(plan.kind, plan.argv, env)
        check = plan.check
        return Plan("check", check=lambda: (_valid_bash("apps/gpu/run.sh")(), check()))
    return None


def expected_status(command: Command) -> int:
    found = re.search(r"exit status (\d+)", command.comment)
    return int(found.group(1)) if found else 0


def test_every_docs_command_has_a_rule():
    commands = all_commands()
    assert len(commands) > 30, "the docs' commands were not found"
    uncovered = [c.where for c in commands if classify(c) is None]
    assert not uncovered, "fenced commands no rule in tests/test_docs_commands.py covers:\n" + "\n".join(
        uncovered
    )


COMMAND_START = re.compile(
    r"(uv run |titan-(train|data) [-a-z]|torchrun |sbatch |\.?/?apps/\S+\.(sh|py|slurm)\b)"
)


def test_commands_are_in_shell_fences():
    """A command in a fence without a shell language would escape every rule above: it must be marked."""
    unmarked = []
    for page in PAGES:
        fence = None
        for number, raw in enumerate(page.read_text().splitlines(), 1):
            stripped = raw.strip()
            if stripped.startswith(("```", "~~~")):
                fence = (stripped[3:].strip().split(" ")[0].lower() or "-") if fence is None else None
            elif fence == "-" and COMMAND_START.match(stripped):
                unmarked.append(f"{page.relative_to(REPO)}:{number}: {stripped}")
    assert not unmarked, "commands in a fence with no language (mark it ```bash):\n" + "\n".join(unmarked)


def test_docs_commands_for_gpus_clusters_and_the_network_are_checked():
    checked = [(c, classify(c)) for c in all_commands()]
    for command, plan in checked:
        if plan is not None and not plan.runs:
            try:
                plan.check()
            except (AssertionError, subprocess.CalledProcessError) as err:
                raise AssertionError(f"{command.where}: {err}") from None


@pytest.mark.slow
def test_docs_commands_run(tmp_path):
    steps, commands = [], {}
    for i, command in enumerate(all_commands()):
        plan = classify(command)
        if plan is None or not plan.runs:
            continue
        steps.append(
            {
                "id": i,
                "kind": plan.kind,
                "argv": plan.argv,
                "env": {**command.env, **plan.env},
                "scratch": Path(command.page).stem,
            }
        )
        commands[i] = command
    (tmp_path / "plan.json").write_text(json.dumps(steps))
    # One thread: at the test's tiny shapes a second one only spins (5x the CPU time on a busy machine).
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TITAN_KEEP_HOST_MEMORY": "0", "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None), env.pop("RANK", None)
    done = subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path / "plan.json"), str(tmp_path / "results.json")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["id"] for r in results] == [s["id"] for s in steps]
    failures = [
        f"{commands[r['id']].where}\n  exit status {r['rc']}, expected {expected_status(commands[r['id']])}\n"
        f"{r['output'][-1500:]}"
        for r in results
        if r["rc"] != expected_status(commands[r["id"]])
    ]
    assert not failures, "\n\n".join(failures)


def test_config_reference_is_generated_from_the_schema():
    spec = importlib.util.spec_from_file_location(
        "gen", REPO / "apps" / "scripts" / "gen_config_reference.py"
    )
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.PAGE.read_text() == gen.render(), (
        "docs/config-reference.md differs from the schema: run uv run python apps/scripts/gen_config_reference.py"
    )


# What the pages name: relative links, repository paths in backticks, titan_* modules and attributes.
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")
REPO_PATH = re.compile(r"`((?:apps|bench|docs|packages|tests)/[\w./*-]+)`")
DOTTED = re.compile(r"`(titan_(?:models|parallel|data|ckpt|train)(?:\.\w+)+)`")


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(target, name):
                return False
            target = getattr(target, name)
        return True
    return False


def test_files_modules_and_links_named_in_the_docs_exist():
    missing = []
    for page in PAGES:
        text = page.read_text()
        for target, _ in LINK.findall(text):
            if "://" not in target and not (page.parent / target).exists():
                missing.append(f"{page.name}: link {target}")
        for path in REPO_PATH.findall(text):
            if not (any(REPO.glob(path)) if "*" in path else (REPO / path.rstrip("/")).exists()):
                missing.append(f"{page.name}: path {path}")
        for dotted in DOTTED.findall(text):
            if not _resolves(dotted):
                missing.append(f"{page.name}: module {dotted}")
    assert not missing, "the docs name what does not exist:\n" + "\n".join(missing)
