"""The `titan-train` command: train (the default), `report DUMP_FOLDER`, `dry-run --ngpu N`,
`generate --checkpoint PATH` and `eval --checkpoint PATH`."""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from titan_ckpt import CheckpointError
from titan_data import DataError
from titan_models import ModelError
from titan_parallel import ParallelConfigError
from titan_train.comm_backend import apply_comm_backend, check_comm_backend, comm_backend
from titan_train.config import JobConfig, load_job_config
from titan_train.config.run_checks import check_run
from titan_train.distributed import (
    DistInfo,
    configure_flight_recorder,
    init_distributed,
    launched_world_size,
    set_collective_timeout,
    shutdown,
)
from titan_train.errors import ConfigError
from titan_train.fault_tolerance.group_folders import separate_group_outputs
from titan_train.fault_tolerance.lighthouse import check_lighthouse
from titan_train.faults.exit_status import CollectiveHang, EarlyStop
from titan_train.faults.hang_diagnosis import describe_init_failure
from titan_train.faults.peer_watch import watching_peers
from titan_train.faults.status_file import leave_exit_status
from titan_train.objectives.rewards import RewardFailed
from titan_train.objectives.vllm_engine import EngineFailed
from titan_train.plan import RunPlan, resolve
from titan_train.reporting.device_peaks import DEVICE_MEMORY_GIB
from titan_train.reporting.dry_run import dry_run
from titan_train.reporting.report import build_report
from titan_train.step.gc_schedule import libraries_frozen
from titan_train.trainer import Trainer

USER_ERRORS = (
    ConfigError,
    DataError,
    ParallelConfigError,
    CheckpointError,
    ModelError,
    RewardFailed,
    EngineFailed,
)

log = logging.getLogger("titan_train")


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


def report_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="titan-train report", description="Draw a run's loss, throughput, MFU and memory curves."
    )
    parser.add_argument("dump_folder", help="the run's job.dump_folder")
    parser.add_argument("--out", help="PNG to write (default: DUMP_FOLDER/report.png)")
    args = parser.parse_args(argv)
    report = build_report(args.dump_folder, args.out)
    print("\n".join(report.table))
    print(f"curves: {report.png}")
    return 0


def _dry_run_args(argv: list[str]) -> tuple[int, list[str]]:
    parser = argparse.ArgumentParser(
        prog="titan-train dry-run",
        description="Check a config and its layout for N GPUs without GPUs; other flags are config overrides.",
    )
    parser.add_argument("--ngpu", type=int, required=True, help="number of ranks (GPUs) the layout is for")
    parser.add_argument(
        "--device",
        default="H100",
        help=f"GPU whose memory the headroom is against: {', '.join(DEVICE_MEMORY_GIB)}",
    )
    parser.add_argument(
        "--device-memory-gib", type=float, help="memory per GPU in GiB (instead of --device's)"
    )
    args, rest = parser.parse_known_args(argv)
    return args.ngpu, [*rest, "--comm.mode", "fake_backend"], (args.device, args.device_memory_gib)


def exit_status(err: BaseException) -> tuple[int, str]:
    """The exit status and the one line a rank stopping with `err` leaves (its peers print the same)."""
    if isinstance(err, USER_ERRORS):
        return 2, str(err)
    if isinstance(err, EarlyStop):
        return err.exit_code, str(err)
    return 1, f"rank {os.environ.get('RANK', '0')} failed: {type(err).__name__}: {err}"


def plan_run(config: JobConfig) -> RunPlan:
    """The plan of a training run on the world torchrun launched, every check passed, before the
    run joins its process group: a mistake costs seconds and is one line (exit status 2)."""
    world_size, device_type = launched_world_size(), "cuda" if torch.cuda.is_available() else "cpu"
    check_run(config, world_size=world_size, device_type=device_type)
    if config.fault_tolerance.enable:
        check_lighthouse()  # only group rank 0 talks to it, but every rank would wait on a missing one
        separate_group_outputs(config)
    check_comm_backend(config, device_type)
    return resolve(config, world_size, device_type)


def train_joined(plan: RunPlan, info: DistInfo, closing: contextlib.ExitStack, watch=None) -> Trainer:
    """Build the trainer on the joined group and train; `watch` (the peer watch) follows its steps."""
    trainer = Trainer(plan, info, closing)
    if watch is not None:
        watch.position = trainer.guard.position
    set_collective_timeout(plan.config.comm.train_timeout_seconds)
    trainer.train()
    return trainer


def train(argv: list[str], world_size: int | None = None, device: tuple = ("H100", None)) -> int:
    # Every field and combination is checked here, before any work (see titan_train.config.validate).
    config = load_job_config(argv, check_paths=True)
    if config.comm.mode == "fake_backend":
        comm_backend()  # a dry run plans for other machines: only the name is checked here
        world_size = world_size or int(os.environ.get("WORLD_SIZE") or os.environ.get("NGPU") or 1)
        dry_run(config, world_size, *device)
        return 0
    plan = plan_run(config)
    # The run's garbage collections walk only what it builds, not torch and the libraries (gc_schedule).
    with libraries_frozen():
        return _join_and_train(plan)


def _join_and_train(plan: RunPlan) -> int:
    """Join the process group, train, and leave it with every rank."""
    config = plan.config
    apply_comm_backend(comm_backend())
    c = config.comm
    configure_flight_recorder(
        c.trace_buf_size, Path(config.job.dump_folder) / c.save_traces_folder, c.save_traces_file_prefix
    )
    try:
        info = init_distributed(c.init_timeout_seconds)
    except dist.DistError as err:
        raise CollectiveHang(describe_init_failure(err, c.init_timeout_seconds)) from None
    traces = Path(config.job.dump_folder) / c.save_traces_folder if c.trace_buf_size > 0 else None
    try:
        # One stack closes the run: the peer watch first in, last out (see Trainer.train). train()
        # closes it when training ends; this `with` does if building the trainer fails.
        with contextlib.ExitStack() as closing:
            watch = closing.enter_context(
                watching_peers(info.rank, info.world_size, traces, c.save_traces_file_prefix, exit_status)
            )
            train_joined(plan, info, closing, watch)
    except EarlyStop as stop:
        if isinstance(stop, CollectiveHang):  # a peer may never arrive: leave at once
            shutdown(wait_for_peers=False)
            raise
        # A stop every rank reaches at the same step (preemption, non-finite numbers, an agreed data
        # outage) leaves as a finished run does: the trainer, held by the traceback's frames, is freed
        # first, so its process groups close with it, and then the ranks leave together. A rank that
        # left early, or kept gloo's connections open into the interpreter's exit, made its peer abort
        # (SIGABRT, seen once in CI) instead of exiting with the stop's status.
        stop.__traceback__ = stop.__context__ = stop.__cause__ = None
        gc.collect()
        shutdown()
        raise stop from None
    except BaseException:
        shutdown(wait_for_peers=False)
        raise
    # Free the model and optimizer state (held in reference cycles) before the last barrier, which
    # needs a little GPU memory of its own.
    watch = None
    gc.collect()
    shutdown()
    return 0


def run(argv: list[str]) -> int:
    """Dispatch to a subcommand or train; a user's mistake is logged as one line and exits with 2.

    Runs that stop early on purpose exit with their own status: 3 preempted (checkpoint saved), 4
    non-finite numbers, 5 a hang or a lost peer (see `titan_train.faults.exit_status`).
    """
    try:
        if argv[:1] == ["report"]:
            return report_main(argv[1:])
        if argv[:1] == ["dry-run"]:
            world_size, rest, device = _dry_run_args(argv[1:])
            return train(rest, world_size, device)
        if argv[:1] == ["check"]:
            from titan_train.commands.check import check_main

            return check_main(argv[1:])
        if argv[:1] == ["generate"]:
            from titan_train.commands.generate import generate_main

            return generate_main(argv[1:])
        if argv[:1] == ["eval"]:
            from titan_train.commands.eval import eval_main

            return eval_main(argv[1:])
        return train(argv)
    except USER_ERRORS as err:
        log.error("%s", err)
        return 2
    except EarlyStop as stop:
        log.log(stop.log_level, "%s", stop)
        if isinstance(stop, CollectiveHang):
            # After a timed-out collective, gloo's threads abort the interpreter's exit; leave at once.
            leave_exit_status(stop.exit_code)
            logging.shutdown()
            os._exit(stop.exit_code)
        return stop.exit_code


def main(argv: list[str] | None = None) -> int:
    """The console entry point: rank-prefixed logging to stdout, then `run`."""
    setup_logging()
    code = run(list(sys.argv[1:] if argv is None else argv))
    leave_exit_status(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
