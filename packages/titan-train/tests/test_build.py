"""Builders that turn config sections into an optimizer, a model in the asked dtype, and a GC schedule."""

import gc
import weakref

import pytest
import torch

from titan_train.config import load_job_config
from titan_train.errors import ConfigError
from titan_train.plan import resolve
from titan_train.registry import get_model_family
from titan_train.step.gc_schedule import GarbageCollection, libraries_frozen
from titan_train.wiring.data import build_tokenizer_for
from titan_train.wiring.loss import build_loss_fn
from titan_train.wiring.model import build_model
from titan_train.wiring.optimizers import build_lr_schedule, build_optimizer
from titan_train.wiring.precision import compute_dtype

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "name,implementation,cls,foreach,fused",
    [
        ("AdamW", "foreach", torch.optim.AdamW, True, False),
        ("Adam", "for-loop", torch.optim.Adam, False, False),
        ("AdamW", "fused", torch.optim.AdamW, False, True),
    ],
)
def test_adam_and_adamw_with_each_implementation(name, implementation, cls, foreach, fused):
    config = load_job_config(
        [
            "--optimizer.name",
            name,
            "--optimizer.implementation",
            implementation,
            "--optimizer.weight_decay",
            "0.05",
            "--optimizer.beta2",
            "0.99",
        ]
    )
    optimizer = build_optimizer(config, torch.nn.Linear(4, 4))
    assert type(optimizer) is cls
    group = optimizer.param_groups[0]
    assert (group["foreach"], group["fused"]) == (foreach, fused)
    assert (group["weight_decay"], group["betas"]) == (0.05, (0.9, 0.99))


def test_bfloat16_training_dtype_puts_parameters_in_bfloat16_and_keeps_buffers_float32(one_rank):
    config = load_job_config(["--training.dtype", "bfloat16", "--training.seq_len", "32"])
    plan = resolve(config, 1, "cpu")
    plan.dims.build_mesh("cpu")
    (model,) = build_model(plan, CPU, eos_id=build_tokenizer_for(config).eos_id, seed=0).parts
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert all(b.dtype in (torch.float32, torch.complex64) for b in model.buffers())
    optimizer = build_optimizer(config, model)
    assert optimizer.param_groups[0]["params"][0].dtype == torch.bfloat16


def test_float32_training_with_mixed_precision_on_cpu_computes_in_float32(caplog):
    config = load_job_config(["--training.mixed_precision_param", "bfloat16"])
    assert compute_dtype(config, CPU) == torch.float32
    assert "kept as float32 on CPU" in caplog.text


def test_lr_schedule_spans_total_steps_when_given():
    config = load_job_config(
        ["--training.steps", "10", "--lr_scheduler.total_steps", "100", "--lr_scheduler.warmup_steps", "0"]
    )
    optimizer = build_optimizer(config, torch.nn.Linear(2, 2))
    schedule = build_lr_schedule(config, optimizer, config.training.steps)
    for _ in range(10):
        optimizer.step()
        schedule.step()
    # Linear decay over 100 steps, not 10 (the peak at step 1, then 1/100 less per step): step 11 still
    # gets 90% of the peak.
    assert schedule.get_last_lr()[0] == pytest.approx(config.optimizer.lr * 0.90, rel=1e-6)


def test_garbage_is_collected_on_schedule_and_automatic_collection_comes_back():
    schedule = GarbageCollection(gc_freq=3)
    assert not gc.isenabled()
    collections = gc.get_stats()[2]["collections"]
    for step in range(1, 7):
        schedule.step(step)
    assert gc.get_stats()[2]["collections"] - collections == 2  # full collections at steps 3 and 6
    schedule.close()
    assert gc.isenabled() and gc.get_freeze_count() == 0


class _Cycle:
    def __init__(self):
        self.me = self


def test_cyclic_garbage_that_outlived_a_collection_is_freed_at_the_next():
    """An async checkpoint's metadata is alive at one collection and garbage by the next: it must go then."""
    schedule = GarbageCollection(gc_freq=1)
    try:
        survivor = _Cycle()
        freed = weakref.ref(survivor)
        schedule.step(1)  # alive here: promoted to the oldest generation
        del survivor
        schedule.step(2)
        assert freed() is None
    finally:
        schedule.close()


def test_loss_is_compiled_only_when_compile_components_name_it_and_gives_the_eager_value():
    spec = get_model_family("llama3")
    logits, labels = torch.randn(2, 16, 64, requires_grad=True), torch.randint(0, 64, (2, 16))
    plain = ["--training.no_chunked_loss"]  # the model's own loss, so `eager` is that function itself
    eager = build_loss_fn(
        load_job_config([*plain, "--compile.enable", "--compile.components", "model"]), spec
    )
    compiled = build_loss_fn(load_job_config([*plain, "--compile.enable"]), spec)
    assert eager is spec.loss_fn
    assert compiled is not spec.loss_fn  # [compile] components = ["model", "loss"] by default
    expected = eager(logits, labels)
    (grad_eager,) = torch.autograd.grad(expected, logits)
    got = compiled(logits, labels)
    (grad_compiled,) = torch.autograd.grad(got, logits)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(grad_compiled, grad_eager)


def test_unknown_compile_component_is_refused_when_read():
    # validate_config is the one place this rule lives: build_loss_fn trusts a config that went through it.
    flags = ["--compile.enable", "--compile.components", "model,optimizer"]
    with pytest.raises(ConfigError, match=r"compile.components has 'optimizer', which is not one of"):
        load_job_config(flags)


def test_a_run_collects_what_it_built_without_walking_older_objects_and_frees_old_garbage_after():
    """titan-train's collections skip what existed before the run (torch's heap: 0.23 s a walk), still free
    what the run built, and older garbage is handed back to the collector once the run ends."""
    old = _Cycle()
    old_freed = weakref.ref(old)
    gc.collect()  # alive here: promoted to the oldest generation
    del old
    with libraries_frozen():
        schedule = GarbageCollection(gc_freq=1)
        try:
            built = _Cycle()
            built_freed = weakref.ref(built)
            del built
            schedule.step(1)
            assert built_freed() is None  # the run's own garbage goes at its collections
            assert old_freed() is not None  # older objects are not walked
        finally:
            schedule.close()
        gc.collect()  # as titan-train does once training ends, before the last barrier
        assert old_freed() is not None
    gc.collect()
    assert old_freed() is None  # not frozen for good


def test_a_heap_frozen_before_the_run_stays_frozen_after_it():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with libraries_frozen():
            pass
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
