"""The `titan-train` command."""

from __future__ import annotations

import logging
import os
import sys

from titan_ckpt import CheckpointError
from titan_data import DataError
from titan_parallel import ParallelConfigError
from titan_train.config import load_job_config
from titan_train.distributed import init_distributed, set_collective_timeout, shutdown
from titan_train.errors import ConfigError
from titan_train.trainer import Trainer

USER_ERRORS = (ConfigError, DataError, ParallelConfigError, CheckpointError)


def setup_logging() -> None:
    # torchrun's --tee already prefixes each line with the rank.
    prefix = "" if "TORCHELASTIC_RUN_ID" in os.environ else f"[rank{os.environ.get('RANK', '0')}] "
    logging.basicConfig(
        level=logging.INFO,
        format=f"{prefix}%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stdout,
        force=True,
    )


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    log = logging.getLogger("titan_train")
    try:
        config = load_job_config(argv)
        info = init_distributed(config.comm.init_timeout_seconds)
        try:
            trainer = Trainer(config, info)
            set_collective_timeout(config.comm.train_timeout_seconds)
            trainer.train()
        except BaseException:
            shutdown(wait_for_peers=False)
            raise
        shutdown()
    except USER_ERRORS as err:
        log.error("%s", err)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
