"""torchft replica groups: the replicate dimension across torchrun jobs, and what a failure costs."""

from titan_train.fault_tolerance.heal_state import HealState
from titan_train.fault_tolerance.lighthouse import LIGHTHOUSE_ENV, check_lighthouse, start_lighthouse
from titan_train.fault_tolerance.replica_group import ReplicaCounts, ReplicaGroup

__all__ = [
    "LIGHTHOUSE_ENV",
    "HealState",
    "ReplicaCounts",
    "ReplicaGroup",
    "check_lighthouse",
    "start_lighthouse",
]
