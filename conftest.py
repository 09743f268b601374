"""Suite-wide hooks: the longest test files start first, and a test that leaves a default process group
behind fails itself, not the tests after it."""

import pytest
import torch.distributed as dist

# With `--dist loadfile` each file is one unit of work. xdist's default hands out the files with the most
# tests first, which starts the few-test, many-minute end-to-end files last, where one can run on alone at the
# end. These start first instead, longest first (beside each, its test-seconds in a 3-worker run, 2026-11-26);
# the floor check (tests/test_dependency_rule.py, minutes when .ci/run turns it on) leads.
LONGEST_FIRST = (
    "tests/test_dependency_rule.py",
    "packages/titan-train/tests/test_every_field_is_honoured.py",  # 645
    "tests/test_train_layouts.py",  # 328
    "tests/test_train_end_to_end.py",  # 297
    "tests/slurm/test_slurm_jobs.py",  # 282
    "tests/test_torchtitan_features.py",  # 222
    "packages/titan-train/tests/test_dry_run.py",  # 165
    "packages/titan-train/tests/test_traced_memory.py",  # 161
    "tests/test_generate_eval.py",  # 151
    "tests/test_docs_commands.py",  # 145
    "packages/titan-parallel/tests/test_layouts.py",  # 131
    "packages/titan-train/tests/test_pipeline_replay.py",  # 109
    "tests/test_fault_multinode.py",  # 104
    "packages/titan-train/tests/test_memory_against_gpu.py",  # 99
    "tests/test_apps.py",  # 95
)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # xdist is installed
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


@pytest.fixture(autouse=True)
def _no_leaked_process_group(request):
    """With `--dist loadfile` a worker runs many modules in one process; a group left initialized by one of
    them makes every later `init_process_group` fail far from the cause. Module-scoped fixtures that hold a
    group on purpose set it up before the test starts, so only a group that appears during a test and
    outlives it counts as a leak."""
    held_before = dist.is_available() and dist.is_initialized()
    yield
    if not held_before and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail(f"{request.node.nodeid} left a default process group initialized (destroyed now)")
