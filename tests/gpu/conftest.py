"""Shared set-up of the GPU tests: the CUDA skip, a one-rank NCCL group, models and a measurement report.

Run on a CUDA machine with `python -m pytest -m gpu tests/gpu -q`. Measurements (errors against the
references, timings, loss-curve gaps) are listed at the end of the run under "Titan GPU measurements",
whatever the output capture, and appended to `$TITAN_GPU_REPORT_DIR/gpu_measurements.jsonl` when
that variable is set, so that the tolerances can be tightened from a real run.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from titan_models import Transformer, llama3_args

REPO = Path(__file__).resolve().parents[2]
_MEASUREMENTS: list[str] = []


def pytest_runtest_setup(item: pytest.Item) -> None:
    # Before any fixture runs, so that nothing touches CUDA on a machine without it.
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def pytest_terminal_summary(terminalreporter) -> None:
    if not _MEASUREMENTS:
        return
    terminalreporter.section("Titan GPU measurements")
    for line in _MEASUREMENTS:
        terminalreporter.write_line(line)


def _device_line() -> str:
    name = torch.cuda.get_device_name()
    major, minor = torch.cuda.get_device_capability()
    return json.dumps({"device": name, "capability": f"{major}.{minor}", "torch": torch.__version__})


@pytest.fixture
def report(request) -> Callable[..., None]:
    """`report(key=value, ...)`: record this test's measurements (call it before asserting on them)."""

    def write(**values) -> None:
        if not _MEASUREMENTS:
            _MEASUREMENTS.append(_device_line())
        rounded = {k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in values.items()}
        line = json.dumps({"test": request.node.name, **rounded})
        _MEASUREMENTS.append(line)
        print(line)
        folder = os.environ.get("TITAN_GPU_REPORT_DIR")
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
            with open(Path(folder) / "gpu_measurements.jsonl", "a", encoding="utf-8") as f:
                f.write(line + "\n")

    return write


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def one_rank_nccl_group():
    """A real NCCL process group of one rank on GPU 0, destroyed after the test whatever its outcome."""
    if dist.is_initialized():  # never expected: every test here destroys its own group
        dist.destroy_process_group()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=dt.timedelta(seconds=120),
        device_id=device,
    )
    try:
        yield device
    finally:
        dist.destroy_process_group()


@pytest.fixture
def float8_gpu() -> None:
    """Skip where the GPU has no float8 matmuls (compute capability below 8.9)."""
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        pytest.skip(
            f"float8 needs compute capability >= 8.9; this GPU ({torch.cuda.get_device_name()}) is {major}.{minor}"
        )


@pytest.fixture
def build_model() -> Callable[..., Transformer]:
    """`build_model(transform=None, seed=0, **arg_overrides)`: a llama3 debugmodel (dim 256) on CUDA.

    Built the trainer's way: on the meta device, `transform` applied there (float8, FSDP, ...), then
    materialised and initialised, so equal seeds give equal weights whatever the transform.
    """

    def build(
        transform: Callable[[Transformer], object] | None = None, seed: int = 0, **overrides
    ) -> Transformer:
        args = replace(llama3_args("debugmodel"), **overrides)
        with torch.device("meta"):
            model = Transformer(args)
        if transform is not None:
            transform(model)
        model.to_empty(device="cuda")
        model.init_weights(buffer_device=torch.device("cuda"), seed=seed)
        return model

    return build


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """‖got − expected‖ / ‖expected‖, computed in float64."""
    got, expected = got.detach().double(), expected.detach().double()
    return ((got - expected).norm() / expected.norm()).item()


@pytest.fixture
def rel_error() -> Callable[[torch.Tensor, torch.Tensor], float]:
    return relative_error


@pytest.fixture
def token_batch() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """`token_batch(batch, seq, seed, vocab=2048)`: random (inputs, labels) on CUDA, labels shifted by one."""

    def make(batch: int, seq: int, seed: int, vocab: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))
        tokens = tokens.cuda()
        return tokens[:, :-1], tokens[:, 1:]

    return make
