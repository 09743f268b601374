"""Pipeline traces that replay their middle micro-batches against traces that run every one."""

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest

from titan_train.config import load_job_config
from titan_train.plan import resolve
from titan_train.registry import get_model_family, register_flavor
from titan_train.reporting.traced_memory import trace_rank

register_flavor("llama3", "debug_4_layers", get_model_family("llama3").args_for("debugmodel", n_layers=4))
REPLAY_SMALL = [
    "--model.flavor",
    "debugmodel",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "6",
    "--parallelism.pipeline_parallel_degree",
    "2",
    "--parallelism.pipeline_parallel_microbatch_size",
    "1",
]
REPLAY_CASES = {
    "interleaved-full": (
        4,
        [0, 2],
        [
            "--parallelism.pipeline_parallel_schedule",
            "Interleaved1F1B",
            "--activation_checkpoint.mode",
            "full",
        ],
    ),
    "interleaved-none": (
        4,
        [2],
        [
            "--parallelism.pipeline_parallel_schedule",
            "Interleaved1F1B",
            "--activation_checkpoint.mode",
            "none",
        ],
    ),
    "1f1b-op": (
        4,
        [0, 2],
        [
            "--parallelism.pipeline_parallel_schedule",
            "1F1B",
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective_ac_option",
            "op",
        ],
    ),
    "gpipe-every2": (
        4,
        [2],
        [
            "--parallelism.pipeline_parallel_schedule",
            "GPipe",
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective_ac_option",
            "2",
        ],
    ),
    # One block per stage (4 layers over 4 stages): the last stage's loss of a replayed micro-batch follows
    # another stage's backward, so the loss must replay under its own label (it was labelled under the backward's).
    "interleaved-one-block": (
        4,
        [2],
        [
            "--model.flavor",
            "debug_4_layers",
            "--parallelism.pipeline_parallel_schedule",
            "Interleaved1F1B",
            "--activation_checkpoint.mode",
            "none",
        ],
    ),
    "tp2-interleaved-full": (
        8,
        [0, 4],
        [
            "--parallelism.pipeline_parallel_schedule",
            "Interleaved1F1B",
            "--activation_checkpoint.mode",
            "full",
            "--parallelism.tensor_parallel_degree",
            "2",
        ],
    ),
}


@pytest.fixture(scope="module")
def full_and_replayed() -> dict[str, list]:
    """Each case's ranks traced with every micro-batch run and with the middle ones replayed, each trace in a
    fresh process (after a pipeline of one fake world, DTensor's caches hold meshes another world lacks)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["titan_train.reporting.traced_memory"])
    with ProcessPoolExecutor(3, mp_context=context, max_tasks_per_child=1) as pool:
        traced = {
            name: [
                [
                    pool.submit(
                        trace_rank,
                        resolve(load_job_config(REPLAY_SMALL + flags), world_size),
                        rank,
                        replay_microbatches=r,
                    )
                    for r in (False, True)
                ]
                for rank in ranks
            ]
            for name, (world_size, ranks, flags) in REPLAY_CASES.items()
        }
        return {name: [[f.result() for f in pair] for pair in pairs] for name, pairs in traced.items()}


@pytest.mark.slow
@pytest.mark.parametrize("case", REPLAY_CASES)
def test_replayed_microbatches_trace_the_step_that_running_them_does(case, full_and_replayed):
    """FSDP x PP (and TP) on a fake world, 6 micro-batches: with micro-batches 2 to 4 of each stage replayed
    from micro-batch 1's capture, the trace allocates what the full one does in the same order and frees
    the same storages between the same allocations (so the caching allocator replayed on it reserves the
    same), and its peak, where it happens, what it holds then and each phase's peak are the full trace's."""
    for full, replayed in full_and_replayed[case]:
        assert _events(replayed) == _events(full)
        assert (replayed.peak, replayed.label, replayed.breakdown) == (full.peak, full.label, full.breakdown)
        assert replayed.by_label == full.by_label


def _events(trace) -> list:
    """The allocations in order, storages numbered as they are first allocated, and between two allocations
    the set of storages freed: the order in which Python drops a batch of tensors changes no total, peak or
    choice of the caching allocator (405B's last stage frees its micro-batches' loss graphs in another order
    when they were replayed)."""
    order: dict[int, int] = {}
    events, freed = [], set()
    for key, size in trace.sizes:
        if size:
            events += [frozenset(freed)] if freed else []
            freed = set()
            events.append((order.setdefault(key, len(order)), size, trace.streams[key]))
        elif key in order:
            freed.add(order[key])
    return events + ([frozenset(freed)] if freed else [])
