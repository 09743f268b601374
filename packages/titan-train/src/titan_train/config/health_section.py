"""(Titan) The [health] section: how a run reacts to numerical faults and preemption, and fault drills.

torchtitan's [fault_tolerance] configures torchft replicas; these fields are Titan's own, so they live in
a section of their own and no torchtitan name changes meaning.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Any

from titan_train.config.fields import MAX_RANKS, MAX_STEPS, opt
from titan_train.errors import ConfigError


def parse_signals(names: list[str]) -> list[signal.Signals]:
    """`["SIGTERM", "USR1"]` as signals, or a ConfigError naming the bad one."""
    parsed = []
    for name in names:
        full = name.strip().upper()
        full = full if full.startswith("SIG") else f"SIG{full}"
        sig = getattr(signal.Signals, full, None)
        if sig is None or sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ConfigError(
                f"config: health.preemption_signals has '{name}', which is not a signal a process can catch; "
                "use names such as SIGTERM, SIGUSR1, SIGUSR2"
            )
        parsed.append(sig)
    return parsed


@dataclass
class Health:
    on_nonfinite: str = opt(
        "stop",
        "(Titan) A non-finite loss or gradient norm: stop (exit status 4, naming step, rank and value) "
        "or skip that step's update",
        choices=("stop", "skip"),
    )
    max_skipped_steps: int = opt(
        5,
        "(Titan) With on_nonfinite = skip: stop once this many updates were skipped since the run started",
        minimum=0,
        maximum=MAX_STEPS,
    )
    loss_spike_ratio: float = opt(
        2.0,
        "(Titan) Report a step whose loss is above this multiple of the mean of the previous "
        "loss_spike_window steps; 0: off",
        above=1,
        maximum=1e6,
        sentinels=(0,),
    )
    loss_spike_window: int = opt(
        20, "(Titan) Steps the loss-spike baseline averages", minimum=1, maximum=MAX_STEPS
    )
    preemption_signals: list[str] = opt(
        ["SIGTERM", "SIGUSR1"],
        "(Titan) Signals on which every rank finishes the current step, saves a checkpoint and exits with "
        "status 3 (SLURM sends SIGTERM on preemption, and the signal of sbatch --signal before the time limit); "
        "empty: Python's default handling",
        check=parse_signals,
    )
    drill: str = opt(
        "none",
        "(Titan) Fault drill on drill_rank at drill_step, to rehearse recovery: kill (SIGKILL after the step, "
        "first attempt only), nan (the loss becomes NaN), hang (stops responding before the step, first "
        "attempt only), stall (waits before the step until a preemption signal such as the time-limit "
        "warning arrives, first attempt only)",
        choices=("none", "kill", "nan", "hang", "stall"),
    )
    drill_step: int = opt(
        0,
        "(Titan) The step a fault drill hits (at least 1 when drill is not none)",
        minimum=0,
        maximum=MAX_STEPS,
    )
    drill_rank: int = opt(0, "(Titan) The rank a fault drill hits", minimum=0, maximum=MAX_RANKS)


def check_health(config: Any) -> None:
    """A fault drill names the step it hits; the rank it hits is checked against the world size at start
    (`titan_train.config.run_checks`)."""
    h = config.health
    if h.drill != "none" and h.drill_step < 1:
        raise ConfigError(
            f"config: health.drill = {h.drill} needs health.drill_step >= 1, got {h.drill_step}"
        )
