"""The job configuration and how it is read."""

from titan_train.config.parse import build_parser, config_to_dict, load_job_config
from titan_train.config.schema import JobConfig

__all__ = ["JobConfig", "build_parser", "config_to_dict", "load_job_config"]
