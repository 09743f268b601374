import sys
from pathlib import Path

import pytest

from titan_parallel import UnsupportedDeviceError
from titan_parallel.float8 import check_float8_device

# The toy model lives beside the torchrun workers, which import it as a sibling script.
sys.path.insert(0, str(Path(__file__).parent / "workers"))


@pytest.fixture
def skip_unless_cpu_runs_float8():
    """Call with a recipe: skips, with the torch limitation as the reason, where this torch refuses it on CPU."""

    def check(recipe: str) -> None:
        try:
            check_float8_device("cpu", recipe=recipe)
        except UnsupportedDeviceError as e:
            pytest.skip(str(e))

    return check


@pytest.hookimpl(tryfirst=True)  # before the repository's conftest.py reads the mark
def pytest_collection_modifyitems(items):
    """A `case` its module names in BEYOND_THE_FLOOR is claimed only for a torch or torchao newer than the
    floor: marked `beyond_floor`, so that under .ci/run the main run keeps it (the floor run skips it)."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec and callspec.params.get("case") in getattr(item.module, "BEYOND_THE_FLOOR", ()):
            item.add_marker(pytest.mark.beyond_floor)


@pytest.fixture(scope="session")
def cases_to_launch(request):
    """`cases_to_launch(module, fixture, cases)`: the cases of a module's launch fixture that the session's
    selected tests read, in `cases`' order; all of them once a selected test reads the fixture other than
    through its `case` parameter. Under .ci/run the main run leaves a library's multi-process tests to its
    floor check, except cases claimed only for a newer torch (conftest.py at the repository root): their
    launch then runs those cases alone."""

    def select(module, fixture: str, cases: list[str]) -> list[str]:
        wanted = set()
        for item in request.session.items:
            if getattr(item, "module", None) is not module or fixture not in item.fixturenames:
                continue
            case = item.callspec.params.get("case") if hasattr(item, "callspec") else None
            if case is None:
                return list(cases)
            wanted.add(case)
        return [case for case in cases if case in wanted]

    return select
