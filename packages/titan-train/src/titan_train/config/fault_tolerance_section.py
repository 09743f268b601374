"""The [fault_tolerance] section: torchft replica groups, with torchtitan 0.2.2's names and defaults.

Each replica group is its own torchrun job; torchft's lighthouse (its address in `TORCHFT_LIGHTHOUSE`)
decides which groups take part in each step, and a group that restarts heals from a live one. The
DiLoCo extension's fields (`sync_steps` onwards) apply with `semi_sync_method`. The checks here need the
config only; the lighthouse's reachability is checked at start (`titan_train.fault_tolerance.lighthouse`).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, fields

from titan_train.config.fields import MAX_RANKS, MAX_SECONDS, MAX_STEPS, opt
from titan_train.errors import ConfigError

INSTALL_TORCHFT = "uv sync (torchft is a dependency of titan-train), or pip install 'torchft>=0.2.0'"


def _fragment_names(fragments: list[list[str]]) -> None:
    for i, names in enumerate(fragments):
        if not names or any(not name.strip() for name in names):
            raise ConfigError(
                f"config: fault_tolerance.module_fqns_per_model_fragment[{i}] = {names!r}: each fragment names "
                "one or more modules, e.g. ['tok_embeddings', 'layers.0']"
            )


@dataclass
class FaultTolerance:
    enable: bool = opt(False, "torchft fault-tolerant replica groups (one torchrun job per group)")
    process_group: str = opt(
        "gloo", "torchft process group between replica groups (nccl needs CUDA)", choices=("gloo", "nccl")
    )
    process_group_timeout_ms: int = opt(
        10000,
        "torchft process group timeout: how long a collective waits for a lost group",
        minimum=1,
        maximum=MAX_SECONDS * 1000,
    )
    replica_id: int = opt(0, "This job's replica group, 0 .. group_size - 1", minimum=0, maximum=MAX_RANKS)
    group_size: int = opt(
        0, "Number of torchft replica groups (at least 1 when enable)", minimum=0, maximum=MAX_RANKS
    )
    min_replica_size: int = opt(
        1, "Fewest replica groups a step needs to commit", minimum=1, maximum=MAX_RANKS
    )
    semi_sync_method: str | None = opt(
        None,
        "Semi-synchronous training across groups: local_sgd or diloco; None: gradients averaged every step",
        choices=("local_sgd", "diloco"),
    )
    sync_steps: int = opt(
        5, "Inner steps between synchronisations (semi_sync_method only)", minimum=1, maximum=MAX_STEPS
    )
    should_quantize: bool = opt(
        False, "Quantize the pseudo-gradients before the all-reduce (semi_sync_method only; needs CUDA)"
    )
    fragment_sync_delay: int = opt(
        0,
        "Inner steps between a fragment's all-reduce and its use (Streaming DiLoCo's tau; diloco only)",
        minimum=0,
        maximum=MAX_STEPS,
    )
    fragment_update_alpha: float = opt(
        0.0,
        "Weight of the local parameters when a fragment's global ones are mixed in (diloco only)",
        minimum=0.0,
        maximum=1.0,
    )
    module_fqns_per_model_fragment: list[list[str]] = opt(
        [],
        "Module names of each model fragment, e.g. [['tok_embeddings', 'layers.0'], ['layers.1', 'norm', "
        "'output']] (diloco only); empty: num_fragments even runs of blocks",
        check=_fragment_names,
    )
    num_fragments: int = opt(
        1, "Fragments the model is split into, synced in turn (diloco only)", minimum=1, maximum=MAX_RANKS
    )


_SEMI_SYNC_ONLY = ("sync_steps", "should_quantize")
_DILOCO_ONLY = (
    "fragment_sync_delay",
    "fragment_update_alpha",
    "module_fqns_per_model_fragment",
    "num_fragments",
)


def _changed(ft: FaultTolerance, names: tuple[str, ...] | None = None) -> list[str]:
    defaults = FaultTolerance()
    wanted = names or tuple(f.name for f in fields(FaultTolerance) if f.name != "enable")
    return [f"fault_tolerance.{n}" for n in wanted if getattr(ft, n) != getattr(defaults, n)]


def torchft_installed() -> bool:
    return importlib.util.find_spec("torchft") is not None


def fragment_count(ft: FaultTolerance) -> int:
    """How many fragments DiLoCo syncs in turn: the named ones, else `num_fragments`."""
    return len(ft.module_fqns_per_model_fragment) or ft.num_fragments


def check_fault_tolerance(config) -> None:
    """Refuse, in one line, a [fault_tolerance] the run cannot honour: a field set without `enable` (or a
    DiLoCo field without diloco), a replica outside the groups, a quorum larger than the groups, a step
    that cannot wait for a commit, or torchft missing."""
    ft = config.fault_tolerance
    if not ft.enable:
        changed = _changed(ft)
        if changed:
            raise ConfigError(
                f"config: {', '.join(changed)} set, but fault_tolerance.enable is false, so it would be ignored; "
                "add --fault_tolerance.enable or remove them"
            )
        return
    if not torchft_installed():
        raise ConfigError(
            f"config: fault_tolerance.enable needs torchft, which is not installed; run {INSTALL_TORCHFT}"
        )
    if ft.group_size < 1:
        raise ConfigError(
            "config: fault_tolerance.enable with group_size = 0; set fault_tolerance.group_size to the number "
            "of replica groups (torchrun jobs) training together"
        )
    if ft.replica_id >= ft.group_size:
        raise ConfigError(
            f"config: fault_tolerance.replica_id ({ft.replica_id}) >= group_size ({ft.group_size}); replica "
            f"ids run from 0 to {ft.group_size - 1}"
        )
    if ft.min_replica_size > ft.group_size:
        raise ConfigError(
            f"config: fault_tolerance.min_replica_size ({ft.min_replica_size}) > group_size ({ft.group_size}): "
            "no step could ever commit; set it to at most group_size"
        )
    if ft.semi_sync_method is None:
        changed = _changed(ft, _SEMI_SYNC_ONLY + _DILOCO_ONLY)
        if changed:
            raise ConfigError(
                f"config: {', '.join(changed)} set without fault_tolerance.semi_sync_method, so it would be "
                "ignored; set semi_sync_method = 'diloco' (or 'local_sgd' for sync_steps) or remove them"
            )
    elif ft.semi_sync_method == "local_sgd":
        changed = _changed(ft, _DILOCO_ONLY)
        if changed:
            raise ConfigError(
                f"config: {', '.join(changed)} set with semi_sync_method = 'local_sgd', which averages the whole "
                "model at once; use semi_sync_method = 'diloco' or remove them"
            )
    if ft.module_fqns_per_model_fragment and ft.num_fragments not in (
        1,
        len(ft.module_fqns_per_model_fragment),
    ):
        raise ConfigError(
            f"config: fault_tolerance.num_fragments ({ft.num_fragments}) and module_fqns_per_model_fragment "
            f"({len(ft.module_fqns_per_model_fragment)} fragments) disagree; give one of them"
        )
    if ft.semi_sync_method == "diloco":
        fragments = fragment_count(ft)
        if ft.sync_steps % fragments:
            raise ConfigError(
                f"config: fault_tolerance.sync_steps ({ft.sync_steps}) must be a multiple of the {fragments} "
                "fragments: DiLoCo syncs one fragment at a time, at even intervals"
            )
        if ft.fragment_sync_delay >= ft.sync_steps // fragments:
            raise ConfigError(
                f"config: fault_tolerance.fragment_sync_delay ({ft.fragment_sync_delay}) must be below "
                f"sync_steps / fragments ({ft.sync_steps // fragments}): a fragment's sync must land before "
                "the next fragment's starts"
            )
    if ft.semi_sync_method is not None and config.parallelism.pipeline_parallel_degree > 1:
        raise ConfigError(
            f"config: fault_tolerance.semi_sync_method = {ft.semi_sync_method!r} with pipeline parallelism "
            f"({config.parallelism.pipeline_parallel_degree} model parts): torchft's LocalSGD and DiLoCo hook one "
            "model and one optimizer; set parallelism.pipeline_parallel_degree = 1"
        )
    if config.optimizer.early_step_in_backward:
        raise ConfigError(
            "config: fault_tolerance.enable with optimizer.early_step_in_backward: the optimizer steps inside "
            "backward, before the replica groups agree to commit the step; set early_step_in_backward = false"
        )
