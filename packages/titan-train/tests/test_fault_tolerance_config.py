"""[fault_tolerance] input a run cannot use stops it at start in one line naming the value and the fix.

The replica-group drill itself (a lighthouse, 2 groups, a SIGKILL, a heal) is tests/test_fault_tolerance.py.
"""

import importlib.util
import re
import socket
from types import SimpleNamespace

import pytest
from torch import nn

from titan_train.config import load_job_config
from titan_train.config.fault_tolerance_section import FaultTolerance
from titan_train.errors import ConfigError
from titan_train.fault_tolerance import LIGHTHOUSE_ENV, check_lighthouse, start_lighthouse
from titan_train.fault_tolerance.semi_sync import fragment_problems, model_fragments
from titan_train.plan import resolve

FT = ("--activation_checkpoint.mode", "none", "--fault_tolerance.enable")


@pytest.mark.parametrize(
    "flags,message",
    [
        ((), "group_size = 0; set fault_tolerance.group_size to the number of replica groups"),
        (
            ("--fault_tolerance.group_size", "2", "--fault_tolerance.replica_id", "2"),
            r"replica_id \(2\) >= group_size \(2\)",
        ),
        (
            ("--fault_tolerance.group_size", "2", "--fault_tolerance.min_replica_size", "3"),
            r"min_replica_size \(3\) > group_size \(2\): no step could ever commit",
        ),
        (
            ("--fault_tolerance.group_size", "2", "--fault_tolerance.sync_steps", "10"),
            "fault_tolerance.sync_steps set without fault_tolerance.semi_sync_method",
        ),
        (
            (
                "--fault_tolerance.group_size",
                "2",
                "--fault_tolerance.semi_sync_method",
                "local_sgd",
                "--fault_tolerance.num_fragments",
                "2",
            ),
            "num_fragments set with semi_sync_method = 'local_sgd'",
        ),
        (
            (
                "--fault_tolerance.group_size",
                "2",
                "--fault_tolerance.semi_sync_method",
                "diloco",
                "--fault_tolerance.num_fragments",
                "3",
                "--fault_tolerance.sync_steps",
                "10",
            ),
            r"sync_steps \(10\) must be a multiple of the 3 fragments",
        ),
        (
            (
                "--fault_tolerance.group_size",
                "2",
                "--fault_tolerance.semi_sync_method",
                "diloco",
                "--fault_tolerance.num_fragments",
                "2",
                "--fault_tolerance.sync_steps",
                "4",
                "--fault_tolerance.fragment_sync_delay",
                "2",
            ),
            r"fragment_sync_delay \(2\) must be below sync_steps / fragments \(2\)",
        ),
        (
            ("--fault_tolerance.group_size", "2", "--optimizer.early_step_in_backward"),
            "the optimizer steps inside backward, before the replica groups agree",
        ),
    ],
)
def test_bad_fault_tolerance_input_is_refused_in_one_line(flags, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_job_config([*FT, *flags])
    assert "\n" not in str(err.value)


def test_fault_tolerance_fields_without_enable_are_refused_not_ignored():
    with pytest.raises(
        ConfigError, match="fault_tolerance.replica_id set, but fault_tolerance.enable is false"
    ):
        load_job_config(["--fault_tolerance.replica_id", "1"])


def test_without_torchft_the_message_gives_the_install_command(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else find_spec(name, *a)
    )
    with pytest.raises(
        ConfigError,
        match=r"needs torchft, which is not installed; run uv sync .* pip install 'torchft>=0.2.0'",
    ):
        load_job_config([*FT, "--fault_tolerance.group_size", "2"])


def test_a_lighthouse_that_cannot_be_reached_is_one_line_at_start(monkeypatch):
    monkeypatch.delenv(LIGHTHOUSE_ENV, raising=False)
    with pytest.raises(ConfigError, match="TORCHFT_LIGHTHOUSE is not set; start a lighthouse"):
        check_lighthouse()
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv(LIGHTHOUSE_ENV, f"http://127.0.0.1:{port}")
    with pytest.raises(ConfigError, match=f"127.0.0.1:{port}: the torchft lighthouse cannot be reached"):
        check_lighthouse(timeout_seconds=2)


def test_the_wheels_lighthouse_starts_and_is_reachable(monkeypatch):
    lighthouse = start_lighthouse(1)
    try:
        monkeypatch.setenv(LIGHTHOUSE_ENV, lighthouse.address())
        assert check_lighthouse() == lighthouse.address()
    finally:
        lighthouse.shutdown()


class _Three(nn.Module):
    """Three top-level modules in forward order, as a model's pipeline units."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)

    def pipeline_units(self) -> list[str]:
        return ["a", "b", "c"]


def _diloco(**fields) -> FaultTolerance:
    return FaultTolerance(enable=True, group_size=2, semi_sync_method="diloco", **fields)


def test_diloco_fragments_split_the_model_or_say_why_not():
    """The split of the model, and the plan's one line for each split that cannot work (run on the built
    model, as the plan runs it on the meta-device one); the builder itself refuses them as misuse."""
    model = _Three()
    split = model_fragments(model, _diloco(num_fragments=2, sync_steps=2))
    assert [[id(m) for m in f] for f in split] == [[id(model.a)], [id(model.b), id(model.c)]]
    refused = {
        r"num_fragments \(4\) is more than the model's 3 top-level modules": _diloco(
            num_fragments=4, sync_steps=4
        ),
        "names 'd', which is not a module of the model": _diloco(
            module_fqns_per_model_fragment=[["a", "d"], ["b", "c"]]
        ),
        r"leaves c.weight \(and 1 more\) in no fragment, so it would never sync": _diloco(
            module_fqns_per_model_fragment=[["a"], ["b"]]
        ),
    }
    for message, settings in refused.items():
        (problem,) = fragment_problems(SimpleNamespace(fault_tolerance=settings), model)
        assert re.search(message, problem) and problem.startswith("config: fault_tolerance."), problem
        with pytest.raises(ValueError, match=message):
            model_fragments(model, settings)
    assert (
        fragment_problems(SimpleNamespace(fault_tolerance=_diloco(num_fragments=2, sync_steps=2)), model)
        == []
    )


def test_semi_sync_under_pipeline_parallelism_is_refused_at_start():
    with pytest.raises(ConfigError, match=r"with pipeline parallelism \(2 model parts\)"):
        load_job_config(
            [
                *FT,
                "--fault_tolerance.group_size",
                "2",
                "--fault_tolerance.semi_sync_method",
                "local_sgd",
                "--parallelism.pipeline_parallel_degree",
                "2",
            ]
        )


def test_the_plan_refuses_a_split_the_model_cannot_take():
    """The plan runs the split on its meta-device model, so a bad split stops the run at start."""
    flags = ["--fault_tolerance.group_size", "2", "--fault_tolerance.semi_sync_method", "diloco"]
    config = load_job_config(
        [*FT, *flags, "--fault_tolerance.num_fragments", "50", "--fault_tolerance.sync_steps", "50"]
    )
    with pytest.raises(ConfigError, match=r"num_fragments \(50\) is more than the model's"):
        resolve(config, 1, "cpu")
