"""Helpers for cross-package tests that run the real `titan-train` in fresh processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEBUG_CONFIG = REPO / "apps" / "configs" / "debug_model.toml"


def run_train(
    dump: Path, *overrides: str, nproc: int = 1, timeout: int = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run titan-train on the debug config (via apps/run_train.sh when nproc > 1), `env` added to this
    process's environment."""
    args = ["--job.dump_folder", str(dump), "--metrics.disable_color_printing", *overrides]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if nproc > 1:
        cmd = [str(REPO / "apps" / "run_train.sh"), *args]
        env.update(
            NGPU=str(nproc),
            CONFIG_FILE=str(DEBUG_CONFIG),
            PATH=f"{Path(sys.executable).parent}:{env['PATH']}",
        )
    else:
        cmd = [sys.executable, "-m", "titan_train.cli", "--job.config_file", str(DEBUG_CONFIG), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def logged_losses(dump: Path) -> dict[int, float]:
    """Step -> loss from the run's metrics.jsonl (later lines win, as after a resume)."""
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}


def train_and_read_losses(dump: Path, *overrides: str, nproc: int = 1) -> dict[int, float]:
    """Run titan-train, require success, and return its logged losses by step."""
    result = run_train(dump, *overrides, nproc=nproc)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return logged_losses(dump)


@pytest.fixture(scope="session")
def train():
    return train_and_read_losses


@pytest.fixture(scope="session")
def launch():
    """`launch(dump, *overrides, nproc=1)`: run titan-train and return the finished process (output included)."""
    return run_train
