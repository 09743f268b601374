"""Per-step metrics: the console log line, metrics.jsonl, TensorBoard scalars and Weights & Biases."""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

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
    trained_tps: (
        float  # of those, the tokens whose labels count in the loss (not -100: padding, masked turns)
    )
    tflops: float
    mfu: float | None  # percent; None where the device's peak is unknown
    memory_gib: float  # peak reserved by the caching allocator (what must fit), or peak host RSS on CPU
    memory_pct: float
    memory_active_gib: float | None  # peak bytes in live tensors (CUDA only): reserved minus allocator slack
    data_time_s: float  # seconds per step spent waiting for batches
    data_time_pct: float
    step_time_s: float
    # Models with experts: per MoE layer, max/mean tokens per expert (and their ratio) and the tokens per
    # expert the bias update used, summed over data-parallel ranks; the sequence-wise aux loss when on.
    expert_load: dict[str, dict[str, float]] | None = None
    expert_counts: dict[str, list[float]] | None = None
    aux_loss: float | None = None
    # The training objective's own metrics under their names: MTP's mtp_loss (the mean of the depths'
    # losses; `loss` is main + mtp_loss_weight * it), preference tuning's TRL rewards/* and logps/*.
    objective: dict[str, float] | None = None
    # torchft replica groups: this step's quorum size and what failures cost the group so far
    # (titan_train.fault_tolerance.ReplicaCounts), as ft_* fields.
    fault_tolerance: dict[str, float] | None = None


# torchtitan's TensorBoard tags, so existing dashboards keep working.
TB_TAGS = {
    "loss": "loss_metrics/global_avg_loss",
    "loss_max": "loss_metrics/global_max_loss",
    "grad_norm": "grad_norm",
    "lr": "lr",
    "tokens_seen": "n_tokens_seen",
    "tps": "throughput(tps)",
    "trained_tps": "throughput(trained_tps)",
    "tflops": "tflops",
    "mfu": "mfu(%)",
    "memory_gib": "memory/max_reserved(GiB)",
    "memory_pct": "memory/max_reserved(%)",
    "memory_active_gib": "memory/max_active(GiB)",
    "data_time_s": "time_metrics/data_loading(s)",
    "data_time_pct": "time_metrics/data_loading(%)",
    "step_time_s": "time_metrics/end_to_end(s)",
    "aux_loss": "moe/aux_loss",
    "mtp_loss": "loss_metrics/mtp_loss",
}
PER_LAYER_FIELDS = ("expert_load", "expert_counts")  # in metrics.jsonl; TensorBoard gets the load ratio
VALIDATION_TAGS = {"loss": "validation_metrics/loss", "perplexity": "validation_metrics/perplexity"}


def device_memory(device: torch.device) -> tuple[float, float, float | None]:
    """Peak memory of this rank (GiB), its share of the device (or of host RAM on CPU), and on CUDA the
    peak held by live tensors (GiB), as torchtitan's `max_reserved` and `max_active`."""
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        used = stats.get("reserved_bytes.all.peak", 0)
        active = stats.get("active_bytes.all.peak", 0) / 2**30
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        used = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        active = None
    return used / 2**30, 100.0 * used / total, active


def wants_colour(disabled: bool) -> bool:
    """Whether log lines get ANSI colours: not with `metrics.disable_color_printing`, and not when stdout
    (the log's stream: `titan_train.cli.setup_logging`) is a pipe or a file, where the codes would land
    as text, unless the environment sets FORCE_COLOR (the common convention for a terminal behind a pipe)."""
    return not disabled and (bool(os.environ.get("FORCE_COLOR")) or sys.stdout.isatty())


class MetricsLogger:
    """Writes a log line every `log_freq` steps and, on the ranks that record, the other sinks.

    `dump` gets `metrics.jsonl` (one JSON object per logged step: the machine-readable record of the
    run) and `validation.jsonl`; `tb_folder` TensorBoard events; `wandb_config` (the resolved job
    config) starts a Weights & Biases run. With `all_ranks`, every rank records, each in its own
    TensorBoard folder `rank_N`; otherwise rank 0 does.
    """

    def __init__(
        self,
        *,
        log_freq: int,
        dump: Path,
        rank: int,
        color: bool,
        tb_folder: Path | None = None,
        all_ranks: bool = False,
        wandb_config: dict[str, Any] | None = None,
    ):
        self.log_freq, self.color = log_freq, color
        records = all_ranks or rank == 0
        self.jsonl = self.validation_jsonl = self.writer = self.wandb = None
        self.dump, self.rank = dump, rank
        if rank == 0:
            self.jsonl = open(dump / "metrics.jsonl", "a", encoding="utf-8")
        if tb_folder is not None and records:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(tb_folder / f"rank_{rank}" if all_ranks else tb_folder))
        if wandb_config is not None and records:
            import wandb

            name = wandb_config["job"]["description"] + (f" rank {rank}" if all_ranks else "")
            self.wandb = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "titan"),
                dir=str(dump),
                config=wandb_config,
                name=name,
            )

    def resume_from(self, step: int) -> None:
        """Start the records after `step`, where training goes on: lines a killed run wrote past its last
        checkpoint (or a finished run in the same folder, from a fresh start) are dropped, so each
        step has one line in metrics.jsonl and validation.jsonl across resumes."""
        if self.rank != 0:
            return
        for name in ("jsonl", "validation_jsonl"):
            sink = getattr(self, name)
            path = self.dump / ("metrics.jsonl" if name == "jsonl" else "validation.jsonl")
            if sink is not None:
                sink.close()
            if path.is_file():
                _drop_records_after(path, step)
            setattr(self, name, open(path, "a", encoding="utf-8") if sink is not None else None)

    def should_log(self, step: int) -> bool:
        return step == 1 or step % self.log_freq == 0

    def log(self, m: StepMetrics) -> None:
        c = _Colors(self.color)
        mfu = f"  {c.magenta}mfu: {m.mfu:.2f}%" if m.mfu is not None else ""
        mfu += _moe_summary(m)
        if m.objective:
            mfu += "  " + "  ".join(f"{k}: {v:.4f}" for k, v in m.objective.items())
        if m.fault_tolerance:
            ft = m.fault_tolerance
            mfu += f"  quorum: {ft['ft_quorum_size']}  steps_missed: {ft['ft_steps_missed']}"
        logger.info(
            f"{c.red}step: {m.step:2}  {c.green}loss: {m.loss:7.4f}  {c.yellow}grad_norm: {m.grad_norm:7.4f}  "
            f"{c.turquoise}memory: {m.memory_gib:5.2f}GiB({m.memory_pct:.2f}%)  {c.blue}tps: {round(m.tps):,}  "
            f"trained_tps: {round(m.trained_tps):,}  "
            f"{c.cyan}tflops: {m.tflops:,.2f}{mfu}{c.reset}"
        )
        # A dense model's records keep their fields: the MoE ones appear only for a model with experts.
        record = {
            k: v
            for k, v in asdict(m).items()
            if (v is not None or k not in (*PER_LAYER_FIELDS, "aux_loss"))
            and k not in ("objective", "fault_tolerance")
        }
        record.update(m.objective or {})
        record.update(m.fault_tolerance or {})  # under their names, e.g. mtp_loss or TRL's rewards/margins
        tags = {TB_TAGS[k]: v for k, v in record.items() if k in TB_TAGS and k != "step" and v is not None}
        tags.update({TB_TAGS.get(k, k): v for k, v in (m.objective or {}).items()})
        tags.update({f"fault_tolerance/{k[3:]}": v for k, v in (m.fault_tolerance or {}).items()})
        for layer, load in (m.expert_load or {}).items():
            tags[f"moe/expert_load_max_over_mean/{layer}"] = load["max_over_mean"]
        self._record(self.jsonl, m.step, record, tags)

    def log_validation(self, step: int, loss: float, perplexity: float) -> None:
        c = _Colors(self.color)
        logger.info(
            f"{c.yellow}validation  step: {step:2}  loss: {loss:7.4f}  perplexity: {perplexity:.3f}{c.reset}"
        )
        if self.rank == 0 and self.validation_jsonl is None:
            self.validation_jsonl = open(self.dump / "validation.jsonl", "a", encoding="utf-8")
        record = {"step": step, "loss": loss, "perplexity": perplexity}
        tags = {VALIDATION_TAGS["loss"]: loss, VALIDATION_TAGS["perplexity"]: perplexity}
        self._record(self.validation_jsonl, step, record, tags)

    def log_preference_validation(self, step: int, values: dict[str, float]) -> None:
        """Held-out preference pairs: the loss and TRL's reward metrics, in validation.jsonl under TRL's
        names and in TensorBoard under validation_metrics/ (no perplexity: the loss is not a token NLL)."""
        c = _Colors(self.color)
        line = "  ".join(f"{k}: {v:.4f}" for k, v in values.items())
        logger.info(f"{c.yellow}validation  step: {step:2}  {line}{c.reset}")
        if self.rank == 0 and self.validation_jsonl is None:
            self.validation_jsonl = open(self.dump / "validation.jsonl", "a", encoding="utf-8")
        tags = {f"validation_metrics/{k}": v for k, v in values.items()}
        self._record(self.validation_jsonl, step, {"step": step, **values}, tags)

    def _record(self, jsonl: Any, step: int, record: dict[str, Any], tags: dict[str, float]) -> None:
        if jsonl is not None:
            jsonl.write(json.dumps(record) + "\n")
            jsonl.flush()
        if self.writer is not None:
            for tag, value in tags.items():
                self.writer.add_scalar(tag, value, step)
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.log(tags, step=step)

    def close(self) -> None:
        for sink in (self.writer, self.jsonl, self.validation_jsonl):
            if sink is not None:
                sink.close()
        if self.wandb is not None:
            self.wandb.finish()


def _drop_records_after(path: Path, step: int) -> None:
    """Rewrite a JSON-lines file without the records of steps after `step` (and a torn last line)."""
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record_step = json.loads(line).get("step", 0)
        except ValueError:
            dropped += 1  # a line a killed run left half-written
            continue
        if record_step > step:
            dropped += 1
        else:
            kept.append(line + "\n")
    if dropped:
        partial = path.with_name(path.name + ".partial")
        partial.write_text("".join(kept), encoding="utf-8")
        partial.replace(path)
        logger.info(
            "metrics: %s: dropped %d records after step %d, which this run writes again", path, dropped, step
        )


def _moe_summary(m: StepMetrics) -> str:
    """The console's expert-load summary: the worst layer's max/mean tokens per expert (1.00: balanced)."""
    if not m.expert_load:
        return ""
    worst = max(load["max_over_mean"] for load in m.expert_load.values())
    aux = f"  aux_loss: {m.aux_loss:.4f}" if m.aux_loss is not None else ""
    return f"  expert_load(max/mean): {worst:.2f}{aux}"


class _Colors:
    def __init__(self, enabled: bool):
        codes = dict(red=31, green=32, yellow=33, blue=34, magenta=35, cyan=36, turquoise=96)
        for name, code in codes.items():
            setattr(self, name, f"\033[{code}m" if enabled else "")
        self.reset = "\033[39m" if enabled else ""
