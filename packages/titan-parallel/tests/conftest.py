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
