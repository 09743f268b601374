"""The exit status a rank leaves for its launcher script in a file.

torchrun exits with 1 whatever its ranks exited with, so a SLURM script cannot tell a preempted run
(status 3, checkpoint saved) from a crash. With `TITAN_EXIT_STATUS_DIR` set (apps/multinode_trainer.slurm
sets it per node), each rank writes its status to `<dir>/rank<RANK>` as it leaves.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)


def leave_exit_status(code: int) -> None:
    """Write `code` for this rank where TITAN_EXIT_STATUS_DIR asks (no-op without it)."""
    folder = os.environ.get("TITAN_EXIT_STATUS_DIR")
    if not folder:
        return
    try:
        Path(folder, f"rank{os.environ.get('RANK', '0')}").write_text(f"{code}\n")
    except OSError as err:  # the status is a courtesy to the launcher; never fail the exit over it
        logger.warning("could not write the exit status to %s: %s", folder, err)
