"""Suite-wide guard: a test that leaves a default process group behind fails itself, not the tests after it.

With `--dist loadfile` a worker runs many modules in one process; a group left initialized by one of them
makes every later `init_process_group` (the `one_rank` fixtures, the dry run's fake world) fail far from
the cause. Module-scoped fixtures that hold a group on purpose set it up before the test starts, so only
a group that appears during a test and outlives it counts as a leak.
"""

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _no_leaked_process_group(request):
    held_before = dist.is_available() and dist.is_initialized()
    yield
    if not held_before and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail(f"{request.node.nodeid} left a default process group initialized (destroyed now)")
