"""Per-step metrics: the console log line and TensorBoard scalars."""

from __future__ import annotations

import json
import logging
import os
import resource
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


@dataclass
class StepMetrics:
    step: int
    loss: float  # mean over data-parallel ranks
    loss_max: float
    grad_norm: float
    lr: float
    tokens_seen: int
    tps: float  # tokens per second per device
    tflops: float
    mfu: float | None  # percent; None where the device's peak is unknown
    memory_gib: float
    memory_pct: float
    data_time_pct: float


def device_memory(device: torch.device) -> tuple[float, float]:
    """Peak memory of this rank (GiB) and its share of the device (or of host RAM on CPU)."""
    if device.type == "cuda":
        used = torch.cuda.max_memory_reserved(device)
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        used = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return used / 2**30, 100.0 * used / total


class MetricsLogger:
    """Writes a log line every `log_freq` steps and, on rank 0, TensorBoard scalars and JSON lines.

    `jsonl_path` gets one JSON object per logged step: the machine-readable record of the run.
    """

    def __init__(self, *, log_freq: int, tb_folder: Path | None, jsonl_path: Path | None, rank: int, color: bool):
        self.log_freq = log_freq
        self.color = color
        self.writer = None
        self.jsonl = open(jsonl_path, "a", encoding="utf-8") if jsonl_path is not None and rank == 0 else None
        if tb_folder is not None and rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(tb_folder))

    def should_log(self, step: int) -> bool:
        return step == 1 or step % self.log_freq == 0

    def log(self, m: StepMetrics) -> None:
        c = _Colors(self.color)
        mfu = f"  {c.magenta}mfu: {m.mfu:.2f}%" if m.mfu is not None else ""
        logger.info(
            f"{c.red}step: {m.step:2}  {c.green}loss: {m.loss:7.4f}  {c.yellow}grad_norm: {m.grad_norm:7.4f}  "
            f"{c.turquoise}memory: {m.memory_gib:5.2f}GiB({m.memory_pct:.2f}%)  {c.blue}tps: {round(m.tps):,}  "
            f"{c.cyan}tflops: {m.tflops:,.2f}{mfu}{c.reset}"
        )
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(asdict(m)) + "\n")
            self.jsonl.flush()
        if self.writer is not None:
            for name, value in asdict(m).items():
                if name != "step" and value is not None:
                    self.writer.add_scalar(_TB_NAMES.get(name, name), value, m.step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.jsonl is not None:
            self.jsonl.close()


_TB_NAMES = {
    "loss": "loss_metrics/global_avg_loss",
    "loss_max": "loss_metrics/global_max_loss",
    "grad_norm": "grad_norm",
    "lr": "lr",
    "tokens_seen": "tokens_seen",
    "tps": "tps",
    "tflops": "tflops",
    "mfu": "mfu(%)",
    "memory_gib": "memory/max_reserved(GiB)",
    "memory_pct": "memory/max_reserved(%)",
    "data_time_pct": "time_metrics/data_loading(%)",
}


class _Colors:
    def __init__(self, enabled: bool):
        codes = dict(red=31, green=32, yellow=33, blue=34, magenta=35, cyan=36, turquoise=96)
        for name, code in codes.items():
            setattr(self, name, f"\033[{code}m" if enabled else "")
        self.reset = "\033[39m" if enabled else ""
