"""The package dependency rule (docs/architecture.md, "The dependency rule"): libraries never import
siblings, and each one installs alone in a fresh environment, imports every module there and passes its
tests that are not marked slow."""

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

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


@pytest.mark.slow
@pytest.mark.parametrize("lib", LIBRARIES)
def test_library_installs_alone_and_passes_its_tests(lib, tmp_path):
    uv = shutil.which("uv")
    assert uv, "uv is needed to build fresh environments: pip install uv"
    constraints = tmp_path / "constraints.txt"
    exported = subprocess.run(
        [
            uv,
            "export",
            "--frozen",
            "--no-hashes",
            "--all-packages",
            "--no-emit-workspace",
            "--all-groups",
            "-o",
            str(constraints),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert exported.returncode == 0, exported.stderr
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
            str(constraints),
            f"{REPO / 'packages' / f'titan-{lib}'}[test]",
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
    # Every module imports with this library's own dependencies alone, and its tests not marked slow pass.
    # The slow (multi-process) ones exercise no other dependency; they run in the workspace and on the
    # floor torch (.ci/run), so they are not run a third time here.
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
            "-x",
            "-p",
            "no:cacheprovider",
            "-m",
            "not slow",
            str(REPO / "packages" / f"titan-{lib}" / "tests"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert tests.returncode == 0, tests.stdout[-4000:]
    assert " passed" in tests.stdout, tests.stdout[-2000:]
