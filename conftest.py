"""Suite-wide hooks: every test process computes on one thread, the longest work starts first, each library's
floor check is its own unit of work, and a test that leaves a default process group behind fails itself, not the
tests after it."""

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

# One compute thread per test process (and, through the environment, per process a test starts: torchrun's
# ranks already run one each). The suite runs 3 workers on CI's 2 cores, and the tests' tiny tensors make
# every op a few microseconds of work between OpenMP barriers: with 2 threads per worker, the threads of
# busy workers spin-wait for each other. Measured on this machine under the suite's load: a 64-wide model's
# linear took 34 ms on 2 threads and 0.03 ms on 1 (packages/titan-models/tests/test_generation.py's cache
# test: 36 s against 0.2 s). A value already set (OMP_NUM_THREADS=8 pytest ...) is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# With `--dist loadfile` each file is one unit of work. xdist's default hands out the files with the most
# tests first, which starts the few-test, many-minute end-to-end files last, where one can run on alone at the
# end. These start first instead, longest first (beside each, its test-seconds in a 3-worker run of
# 2026-11-27). An entry is a file or one test of it: the floor check's four libraries (tests/
# test_dependency_rule.py, minutes each when .ci/run turns it on) are units of their own (below), so two
# workers take the two longest ones at once while the third starts the field probes.
FLOOR_CHECK = (
    "tests/test_dependency_rule.py::test_library_installs_alone_on_the_floor_torch_and_passes_its_tests"
)
LONGEST_FIRST = (
    "tests/test_train_layouts.py",  # 637 (512 CPU-s, 2026-11-29), one unit: its launches read each other's saves
    f"{FLOOR_CHECK}[parallel]",  # 357
    f"{FLOOR_CHECK}[models]",  # 473
    "packages/titan-train/tests/test_every_field_is_honoured.py",  # 492
    "tests/slurm/test_slurm_jobs.py",  # 326, mostly waiting on SLURM's clock
    f"{FLOOR_CHECK}[ckpt]",  # 135
    f"{FLOOR_CHECK}[data]",  # 83
    "tests/test_train_end_to_end.py",  # 246
    "packages/titan-train/tests/test_traced_memory.py",  # 234
    "tests/test_docs_commands.py",  # 206
    "tests/test_hf_export_vllm.py",  # new, 197-376 under load 4-5 (vLLM in 5 worker starts)
    "packages/titan-train/tests/test_dry_run.py",  # 195
    "tests/test_torchtitan_features.py",  # 167
    "tests/test_generate_eval.py",  # 158
    "packages/titan-train/tests/test_pipeline_replay.py",  # 133
    "tests/test_fault_multinode.py",  # 95
    "tests/test_production_moe_expert_parallel.py",  # new, 139 under load 16-20
    "tests/test_gpt_oss_context_parallel.py",  # new, 201-241 under load 12-25
    "packages/titan-parallel/tests/test_layouts.py",  # 88
    "tests/test_sft_debug_config.py",  # 86
    "packages/titan-parallel/tests/test_expert_parallel_layouts.py",  # 76
    "tests/test_fault_restarts.py",  # 73
    "tests/test_titan_engine_families.py",  # 62-77 under load (12 families: export, transformers and Titan greedy)
    "packages/titan-parallel/tests/test_compile.py",  # 70
    "tests/test_soak.py",  # 66
    "packages/titan-train/tests/test_lora_checkpoints.py",  # 61
    "tests/test_hf_export_layouts.py",  # 59
    "tests/test_apps.py",  # 56
    # new on 2026-11-28, estimated from single runs under load
    "tests/test_start_from_hf.py",  # ~150
    "packages/titan-train/tests/test_muon_commands.py",  # ~120
    "tests/test_fine_tune_numbers.py",  # ~100
    "packages/titan-train/tests/test_preference_trl.py",  # ~160 (8 runs of TRL beside Titan)
    "packages/titan-train/tests/test_preference.py",  # ~100
    "packages/titan-train/tests/test_data_choices.py",  # ~75
    "tests/test_hf_export_drop_in.py",  # ~60
    "packages/titan-train/tests/test_mtp.py",  # ~60
    "tests/test_hf_start_memory.py",  # 92 (new 2026-12-02, quiet machine): two 4-rank runs of a 285 MB model
    # new on 2026-12-02 (GRPO), single runs beside the full suite
    "packages/titan-train/tests/test_grpo_fsdp.py",  # ~150: two one-process runs, two 2-rank runs
    "packages/titan-train/tests/test_grpo_resume.py",  # ~250: nine runs of four or five steps (2026-12-03)
    "packages/titan-train/tests/test_grpo_trl.py",  # ~45: six TRL runs beside Titan's replays
    "tests/test_grpo_debug_config.py",  # ~100: the debug GRPO config, 13 steps, then 14 one step off-policy
    # landed 2026-12-02 from wip/ (single runs, two workers)
    "packages/titan-train/tests/test_grpo_vllm.py",  # ~130: vLLM starts once, three runs (skips without apps/vllm)
    "tests/test_fault_tolerance.py",  # the torchft kill drill: two replica groups, one killed and healed
    "tests/test_fault_tolerance_semi_sync.py",
    "tests/test_fault_tolerance_checkpoints.py",  # ~120: three launches of 2 groups through run_train.sh
)


def _rank(nodeid: str) -> int:
    """The place of the first LONGEST_FIRST entry that is this test or its file; everything else after them."""
    for i, entry in enumerate(LONGEST_FIRST):
        if nodeid == entry or nodeid.startswith(entry + "::"):
            return i
    return len(LONGEST_FIRST)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # xdist is installed
        config.option.loadscopereorder = False


# With the floor check on (.ci/run), each library's multi-process tests (marked slow) run once, in its floor
# check, on the oldest torch the library accepts, instead of twice: the main run on the locked torch leaves them
# out, except the cases the floor run skips as claimed only for a newer torch or torchao (marked beyond_floor).
# On the locked torch the layout matrix (tests/test_train_layouts.py) runs the same parallelisms through the
# trainer. Measured 2026-11-28: about 330 CPU-seconds of the main run, of which the cases left take about 100.
LIBRARY_TESTS = tuple(f"packages/titan-{lib}/tests/" for lib in ("models", "parallel", "data", "ckpt"))


def _left_to_the_floor_check(items) -> list:
    floor_on = all(os.environ.get(name) for name in ("TITAN_FLOOR_TORCH", "TITAN_FLOOR_TORCHAO"))
    if not floor_on or not any(item.nodeid.startswith(FLOOR_CHECK) for item in items):
        return []  # no floor check in this session (a library's own run, the floor run itself included)
    return [
        item
        for item in items
        if item.nodeid.startswith(LIBRARY_TESTS)
        and item.get_closest_marker("slow")
        and not item.get_closest_marker("beyond_floor")
    ]


LEFT = pytest.StashKey[set]()


def pytest_collection_modifyitems(config, items):
    left = _left_to_the_floor_check(items)
    if left:
        config.hook.pytest_deselected(items=left)
        ids = {id(item) for item in left}
        items[:] = [item for item in items if id(item) not in ids]
    # A module skipped whole on the floor takes every test of it that was left there with it: "*".
    modules = {Path(str(item.fspath)).stem for item in left}
    config.stash[LEFT] = {(Path(str(item.fspath)).stem, item.name) for item in left} | {
        (m, "*") for m in modules
    }
    items.sort(key=lambda item: _rank(item.nodeid))


@pytest.fixture(scope="session")
def left_to_the_floor_check(request) -> set[tuple[str, str]]:
    """(module name, test name) of the library tests this session leaves to the floor check."""
    return request.config.stash.get(LEFT, set())


@pytest.hookimpl(optionalhook=True)  # the floor check runs library suites where xdist is not installed
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`, except that each library's floor check is a unit of its own (in one unit they held one
    worker for 17 minutes, the suite's longest path)."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FloorChecksApart(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith(FLOOR_CHECK):
                return nodeid
            return super()._split_scope(nodeid)

    return FloorChecksApart(config, log)


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
