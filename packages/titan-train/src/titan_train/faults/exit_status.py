"""Ways a run stops before `training.steps` on purpose, each with its own exit status.

The CLI logs the message as the run's last line and exits with `exit_code`, so a launcher or batch
script can tell a preempted run (resume it) from a numerical fault or a hang (look at it first).
"""

from __future__ import annotations

import logging


class EarlyStop(Exception):
    """Training stopped early; the message is the one line the user needs, naming the cause and the fix."""

    exit_code = 1
    log_level = logging.ERROR


class Preempted(EarlyStop):
    """A preemption signal arrived: the current step finished and a checkpoint was saved."""

    exit_code = 3
    log_level = logging.WARNING


class NonFiniteError(EarlyStop):
    """A loss or gradient norm was NaN or infinite, and the config says to stop (or too many were skipped)."""

    exit_code = 4


class CollectiveHang(EarlyStop):
    """A collective or the process-group start-up timed out, or a peer process vanished mid-collective."""

    exit_code = 5
