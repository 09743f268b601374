"""`titan-train report DUMP_FOLDER`: a run's curves in one PNG and a summary table, from its TensorBoard events.

People would rather look than read: the PNG shows loss (with validation loss), a GRPO run's mean reward,
throughput, MFU (or TFLOP/s where the device's peak is unknown) and memory against the step.
"""

from __future__ import annotations

import json
import logging
import statistics
from dataclasses import dataclass
from pathlib import Path

from titan_train.errors import ConfigError
from titan_train.reporting.metrics import TB_TAGS, VALIDATION_TAGS

Series = dict[str, tuple[list[int], list[float]]]

# (panel title, y label, tags drawn in it: the first one present wins for single-series panels)
PANELS = (
    ("loss", "loss", (TB_TAGS["loss"], VALIDATION_TAGS["loss"])),
    ("reward", "mean reward", ("reward",)),  # learning from rewards (TRL's name, the objective's metric)
    ("throughput", "tokens/s per device", (TB_TAGS["tps"],)),
    ("model FLOPs utilisation", "MFU %", (TB_TAGS["mfu"],)),
    ("achieved TFLOP/s", "TFLOP/s per device", (TB_TAGS["tflops"],)),
    ("memory", "peak GiB", (TB_TAGS["memory_gib"],)),
)
SUMMARY_TAGS = {
    "loss": TB_TAGS["loss"],
    "validation loss": VALIDATION_TAGS["loss"],
    "grad_norm": TB_TAGS["grad_norm"],
    "reward": "reward",
    "tokens/s per device": TB_TAGS["tps"],
    "TFLOP/s": TB_TAGS["tflops"],
    "MFU %": TB_TAGS["mfu"],
    "memory GiB": TB_TAGS["memory_gib"],
    "data loading %": TB_TAGS["data_time_pct"],
}


@dataclass
class RunReport:
    png: Path
    series: Series
    table: list[str]


def find_event_folder(dump: Path) -> Path:
    """The TensorBoard folder of a dump folder (rank 0's where every rank wrote its own)."""
    config_file = dump / "config.json"
    name = json.loads(config_file.read_text())["metrics"]["save_tb_folder"] if config_file.exists() else "tb"
    folder = dump / name
    if (folder / "rank_0").is_dir():
        folder = folder / "rank_0"
    if not folder.is_dir() or not any(folder.glob("events.out.tfevents.*")):
        raise ConfigError(
            f"report: no TensorBoard events in {folder}; train with --metrics.enable_tensorboard to record them"
        )
    return folder


def read_scalars(folder: Path) -> Series:
    """Every scalar tag in `folder`'s event files: tag -> (steps, values); a resumed run's later values win."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logging.getLogger("tensorboard").setLevel(logging.WARNING)  # it logs each file it does not find
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    series: Series = {}
    for tag in events.Tags()["scalars"]:
        by_step = {e.step: e.value for e in events.Scalars(tag)}
        steps = sorted(by_step)
        series[tag] = (steps, [by_step[s] for s in steps])
    return series


def summary_table(series: Series) -> list[str]:
    """Rows of first / last / min / mean / max per metric, aligned for a terminal."""
    rows = [f"{'metric':<22}{'first':>12}{'last':>12}{'min':>12}{'mean':>12}{'max':>12}"]
    for name, tag in SUMMARY_TAGS.items():
        if tag not in series:
            continue
        values = series[tag][1]
        stats = (values[0], values[-1], min(values), statistics.fmean(values), max(values))
        rows.append(f"{name:<22}" + "".join(f"{v:>12,.4g}" for v in stats))
    steps = series[TB_TAGS["loss"]][0] if TB_TAGS["loss"] in series else []
    if steps:
        rows.append(f"steps {steps[0]}..{steps[-1]}, {len(steps)} logged")
    return rows


def draw(series: Series, out: Path, title: str):
    """The report figure, saved to `out` as PNG; returns the matplotlib Figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in PANELS if any(tag in series for tag in p[2])]
    if TB_TAGS["mfu"] in series:  # MFU says more than TFLOP/s where the peak is known
        panels = [p for p in panels if p[0] != "achieved TFLOP/s"]
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.6 * len(panels)), sharex=True, squeeze=False)
    for ax, (name, ylabel, tags) in zip(axes[:, 0], panels, strict=True):
        for tag in tags:
            if tag in series:
                steps, values = series[tag]
                label = "validation" if tag.startswith("validation") else "train"
                ax.plot(steps, values, marker="." if len(steps) < 50 else None, label=label)
        ax.set_title(name)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if len(ax.lines) > 1:
            ax.legend()
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return fig


def build_report(dump: str | Path, out: str | Path | None = None) -> RunReport:
    """Read a run's events, draw `out` (default DUMP/report.png) and compute the summary table."""
    dump = Path(dump)
    if not dump.is_dir():
        raise ConfigError(f"report: {dump} is not a folder; pass a run's job.dump_folder")
    series = read_scalars(find_event_folder(dump))
    if TB_TAGS["loss"] not in series:
        raise ConfigError(f"report: the events in {dump} hold no loss; was it written by titan-train?")
    png = Path(out) if out else dump / "report.png"
    description = (
        json.loads((dump / "config.json").read_text())["job"]["description"]
        if (dump / "config.json").exists()
        else ""
    )
    draw(series, png, title=f"{description} ({dump})" if description else str(dump))
    return RunReport(png=png, series=series, table=summary_table(series))
