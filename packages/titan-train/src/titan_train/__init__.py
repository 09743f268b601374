"""The Titan training app: config, registry, trainer and the `titan-train` command."""

from titan_train.config import JobConfig, load_job_config
from titan_train.errors import ConfigError
from titan_train.trainer import Trainer

__all__ = ["ConfigError", "JobConfig", "Trainer", "load_job_config"]
