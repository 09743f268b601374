"""The package dependency rule (docs/architecture.md, "The dependency rule"): libraries never import
siblings, and each one installs alone in a fresh environment on the oldest torch and torchao the packages
accept, imports every module there and passes all its tests.

The install-alone test runs when TITAN_FLOOR_TORCH and TITAN_FLOOR_TORCHAO name those versions, as
`.ci/run` does. The main suite runs each library's one-process tests on the locked torch too; its
multi-process ones (marked slow) run here only, except the cases claimed for a newer torch than the floor,
which run in the main suite (conftest.py, `_left_to_the_floor_check`)."""

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest

REPO = Path(__file__).resolve().parents[1]
LIBRARIES = ["models", "parallel", "data", "ckpt"]
ALL = [*LIBRARIES, "train"]
IMPORT_EVERY_MODULE = (
    "import importlib, pkgutil, sys; pkg = importlib.import_module(sys.argv[1]); "
    "[importlib.import_module(m.name) for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.')]"
)


def _imported_titan_packages(src: Path) -> set[tuple[str, str]]:
    found = set()
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            found |= {(str(path.relative_to(REPO)), n.split(".")[0]) for n in names if n.startswith("titan_")}
    return found


@pytest.mark.parametrize("lib", LIBRARIES)
def test_library_imports_no_sibling(lib):
    src = REPO / "packages" / f"titan-{lib}"
    offending = {(f, name) for f, name in _imported_titan_packages(src) if name != f"titan_{lib}"}
    assert not offending, f"titan-{lib} imports a sibling: {sorted(offending)}"


def test_only_titan_train_declares_sibling_dependencies():
    for lib in LIBRARIES:
        text = (REPO / "packages" / f"titan-{lib}" / "pyproject.toml").read_text()
        for other in ALL:
            if other != lib:
                assert f'"titan-{other}' not in text, f"titan-{lib} depends on titan-{other}"


FLOOR = {"torch": os.environ.get("TITAN_FLOOR_TORCH"), "torchao": os.environ.get("TITAN_FLOOR_TORCHAO")}


def _name(requirement: str) -> str:
    return re.split(r"[=<>~!; \[]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _constraints(uv: str, out: Path) -> Path:
    """The lock's version of every third-party package, except torch, torchao and what they need: those
    come from resolving the floor torch and torchao alone (the lock's pins are the newest torch's)."""
    exported = subprocess.run(
        [uv, "export", "--frozen", "--no-hashes", "--all-packages", "--no-emit-workspace", "--all-groups"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert exported.returncode == 0, exported.stderr
    floor = subprocess.run(
        [uv, "pip", "compile", "-", "--no-header", "--no-annotate", "-q", "--python", sys.executable],
        input=f"torch=={FLOOR['torch']}\ntorchao=={FLOOR['torchao']}\n",
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert floor.returncode == 0, floor.stderr
    pins = [line for line in floor.stdout.splitlines() if "==" in line]
    taken = {_name(line) for line in pins}
    locked = [
        line
        for line in exported.stdout.splitlines()
        if "==" in line and not line.lstrip().startswith("#") and _name(line) not in taken
    ]
    out.write_text("\n".join([*locked, *pins]) + "\n")
    return out


@pytest.mark.slow
@pytest.mark.timeout(2400)  # a library's whole suite, serially, on a shared 2-core machine
@pytest.mark.skipif(
    not all(FLOOR.values()),
    reason=".ci/run sets TITAN_FLOOR_TORCH and TITAN_FLOOR_TORCHAO to turn on the floor check",
)
@pytest.mark.parametrize("lib", LIBRARIES)
def test_library_installs_alone_on_the_floor_torch_and_passes_its_tests(
    lib, tmp_path, left_to_the_floor_check
):
    uv = shutil.which("uv")
    assert uv, "uv is needed to build fresh environments: pip install uv"
    venv = tmp_path / "venv"
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True, env=env)
    install = subprocess.run(
        [
            uv,
            "pip",
            "install",
            "-q",
            "--python",
            str(python),
            "-c",
            str(_constraints(uv, tmp_path / "constraints.txt")),
            f"{REPO / 'packages' / f'titan-{lib}'}[test]",
            f"torch=={FLOOR['torch']}",
            *([f"torchao=={FLOOR['torchao']}"] if lib == "parallel" else []),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    siblings = [f"titan_{other}" for other in ALL if other != lib]
    probe = "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) for m in sys.argv[1:]))"
    assert subprocess.run([str(python), "-c", probe, *siblings], env=env).returncode == 0, (
        "a sibling is installed"
    )
    version = "import torch; print(torch.__version__.split('+')[0])"
    installed = subprocess.run([str(python), "-c", version], capture_output=True, text=True, env=env)
    assert installed.stdout.strip() == FLOOR["torch"], installed.stdout + installed.stderr
    # Every module imports with this library's own dependencies alone, and all its tests pass.
    imports = subprocess.run(
        [str(python), "-c", IMPORT_EVERY_MODULE, f"titan_{lib}"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert imports.returncode == 0, imports.stderr[-3000:]
    tests = subprocess.run(
        [
            str(python),
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={tmp_path / 'floor.xml'}",
            str(REPO / "packages" / f"titan-{lib}" / "tests"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert tests.returncode == 0, tests.stdout[-6000:]
    assert " passed" in tests.stdout, tests.stdout[-2000:]
    # The main run leaves the library's multi-process tests to this run (conftest.py): none of them may skip
    # here, or no torch runs it.
    skipped = _skipped_tests(tmp_path / "floor.xml")
    assert not skipped & left_to_the_floor_check, (
        f"skipped on the floor and left out of the main run: {sorted(skipped & left_to_the_floor_check)}"
    )


def _skipped_tests(junit: Path) -> set[tuple[str, str]]:
    """(module name, test name) of each test a junit report says was skipped; (module name, "*") for a
    module skipped whole (reported under its own name, without a class)."""
    skipped = set()
    for case in ElementTree.parse(junit).iter("testcase"):
        if case.find("skipped") is not None:
            whole = not case.get("classname")
            module = case.get("name") if whole else case.get("classname")
            skipped.add((module.rsplit(".", 1)[-1], "*" if whole else case.get("name")))
    return skipped
