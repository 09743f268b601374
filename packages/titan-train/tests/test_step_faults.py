"""The per-step fault logic on its own: numerics verdicts, spikes, preemption signals and saves, drills, limits."""

import logging
import math
import os
import signal

import pytest
import torch
from torch import nn

from titan_ckpt import Checkpointer, ModelState, SavePolicy
from titan_models import llama2_args, llama3_args
from titan_train.config import load_job_config
from titan_train.config.health_section import Health, parse_signals
from titan_train.config.run_checks import check_run
from titan_train.errors import ConfigError
from titan_train.faults.drills import FaultDrills
from titan_train.faults.exit_status import NonFiniteError, Preempted
from titan_train.faults.numerics import NumericsGuard, RankNumbers, describe
from titan_train.faults.preemption import PreemptionSignals, save_and_stop
from titan_train.faults.step_guard import StepGuard
from titan_train.plan import resolve


def _guard(**overrides) -> NumericsGuard:
    settings = {
        "on_nonfinite": "stop",
        "max_skipped_steps": 2,
        "loss_spike_ratio": 2.0,
        "loss_spike_window": 3,
    }
    return NumericsGuard(**{**settings, **overrides})


def test_loss_spike_is_reported_once_the_window_is_full(caplog):
    guard = _guard()
    with caplog.at_level(logging.WARNING):
        for step, loss in enumerate([9.0, 3.0, 3.0, 3.0, 6.5, 3.0], start=1):
            guard.observe(step, loss)
    spikes = [r.getMessage() for r in caplog.records if "loss spike" in r.getMessage()]
    # Step 2's 3.0 after 9.0 is a fall; step 5's 6.5 is above 2x the mean of 3.0, 3.0, 3.0.
    assert spikes == [
        "loss spike at step 5: 6.5000 is 2.2x the mean 3.0000 of the previous 3 steps (health.loss_spike_ratio = 2)"
    ]


def test_loss_spike_ratio_zero_reports_nothing(caplog):
    guard = _guard(loss_spike_ratio=0.0)
    with caplog.at_level(logging.WARNING):
        for step, loss in enumerate([1.0, 1.0, 1.0, 100.0], start=1):
            guard.observe(step, loss)
    assert not caplog.records


def test_nonfinite_stop_names_the_step_the_rank_and_the_value():
    ranks = [RankNumbers(0, 2.5, None), RankNumbers(1, math.inf, None)]
    with pytest.raises(NonFiniteError) as stop:
        _guard().nonfinite(7, math.inf, math.nan, ranks)
    assert str(stop.value).startswith(
        "non-finite numbers at step 7: loss inf on rank 1 (finite on ranks 0), gradient norm nan; stopping"
    )
    assert stop.value.exit_code == 4


def test_nonfinite_skip_skips_up_to_the_limit_then_stops_listing_the_steps():
    guard = _guard(on_nonfinite="skip", max_skipped_steps=2)
    ranks = [RankNumbers(0, 1.0, "layers.0.attention.wq.weight")]
    assert guard.nonfinite(3, 1.0, math.inf, ranks) and guard.nonfinite(5, 1.0, math.inf, ranks)
    with pytest.raises(
        NonFiniteError, match=r"3 skipped updates \(steps 3, 5, 8\), more than health.max_skipped"
    ):
        guard.nonfinite(8, 1.0, math.inf, ranks)


def test_a_finite_loss_with_an_overflowing_gradient_names_the_first_bad_parameter():
    line = describe(4, 2.0, math.inf, [RankNumbers(0, 2.0, None), RankNumbers(1, 2.0, "output.weight")])
    assert (
        line
        == "non-finite numbers at step 4: gradient norm inf, first non-finite gradient output.weight on rank 1"
    )


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        (("--health.max_skipped_steps", "-1"), "config: health.max_skipped_steps must be at least 0, got -1"),
        (("--health.loss_spike_ratio", "0.5"), "config: health.loss_spike_ratio must be above 1"),
        (("--health.loss_spike_window", "0"), "config: health.loss_spike_window must be at least 1, got 0"),
    ],
)
def test_bad_numerics_settings_are_refused(flag, message):
    """Refused by the config's own rules at start; the guard built by code refuses them too (a ValueError:
    misuse by code, not a config a user wrote)."""
    with pytest.raises(ConfigError) as refused:
        load_job_config(list(flag))
    assert str(refused.value).startswith(message), refused.value
    field = flag[0].removeprefix("--health.")
    with pytest.raises(ValueError, match=field):
        _guard(**{field: float(flag[1]) if "ratio" in field else int(flag[1])})


def test_signal_names_parse_with_or_without_sig_and_uncatchable_ones_are_refused():
    assert parse_signals(["SIGTERM", "usr1"]) == [signal.SIGTERM, signal.SIGUSR1]
    for bad in ("SIGKILL", "SIGSTOP", "SIGNOPE"):
        with pytest.raises(ConfigError, match=f"'{bad}', which is not a signal a process can catch"):
            parse_signals([bad])


def test_a_real_signal_is_recorded_while_active_and_the_old_handler_comes_back():
    before = signal.getsignal(signal.SIGUSR2)
    with PreemptionSignals([signal.SIGUSR2]) as signals:
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGUSR2)  # a second one changes nothing
        assert signals.received == signal.SIGUSR2
    assert signal.getsignal(signal.SIGUSR2) is before


def _checkpointer(folder) -> Checkpointer:
    model = nn.Linear(4, 4)
    return Checkpointer(folder, {"model": ModelState([model])}, saving=SavePolicy(interval=10))


def test_preemption_saves_the_step_once_and_says_how_to_resume(tmp_path):
    checkpointer = _checkpointer(tmp_path)
    stop = save_and_stop(3, signal.SIGTERM, checkpointer)
    assert isinstance(stop, Preempted) and stop.exit_code == 3
    assert str(stop).startswith(
        f"preempted: SIGTERM received; finished step 3 and saved {tmp_path / 'step-3'} in "
    )
    assert str(stop).endswith("run the same command again to resume from it")
    assert (tmp_path / "step-3").is_dir()
    assert [t.step for t in checkpointer.timings] == [3]
    save_and_stop(3, signal.SIGTERM, checkpointer)  # the step is saved already: no second save
    assert [t.step for t in checkpointer.timings] == [3]


def test_preemption_without_checkpointing_says_the_progress_is_lost():
    stop = save_and_stop(5, signal.SIGUSR1, None)
    assert "SIGUSR1 received; stopped after step 5 without saving (checkpoint.enable is false)" in str(stop)


def test_step_guard_stops_after_a_recorded_signal_but_not_on_the_last_step():
    guard = StepGuard(Health(), rank=0, world_size=1, device=torch.device("cpu"))
    guard.install()
    try:
        guard.begin_step(1)
        assert guard.update_allowed(1, torch.tensor(2.0), torch.tensor(1.0))
        guard.end_step(1, last_step=False, checkpointer=None)  # no signal yet
        os.kill(os.getpid(), signal.SIGTERM)
        guard.begin_step(2)
        assert guard.update_allowed(2, torch.tensor(2.0), torch.tensor(1.0))
        guard.end_step(2, last_step=True, checkpointer=None)  # the run is over anyway
        with pytest.raises(Preempted, match="stopped after step 2"):
            guard.end_step(2, last_step=False, checkpointer=None)
    finally:
        guard.uninstall()


def test_step_guard_skips_a_nan_drill_step_and_names_the_parameter_gradients_are_checked_on():
    weight = nn.Parameter(torch.ones(2))
    health = Health(on_nonfinite="skip", drill="nan", drill_step=2)
    part = nn.Module()
    part.w = weight
    drills = FaultDrills(health, rank=0, world_size=1)
    loss_fn = drills.loss_with_drill(
        lambda w: (w * 3).sum()
    )  # wrapped before the guard exists, as in training
    guard = StepGuard(
        health, rank=0, world_size=1, device=torch.device("cpu"), drills=drills, watched_parts=[part]
    )
    guard.begin_step(2)
    loss = loss_fn(weight)
    loss.backward()
    assert not guard.update_allowed(2, loss.detach(), weight.grad.norm())
    assert guard.numerics.skipped_steps == [2]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ("--health.drill", "kill", "--health.drill_step", "0"),
            "health.drill = kill needs health.drill_step >= 1, got 0",
        ),
        (
            ("--health.drill", "nan", "--health.drill_step", "3", "--health.drill_rank", "4"),
            "health.drill_rank (4) is not a rank of this 2-rank job",
        ),
    ],
)
def test_drills_refuse_a_missing_step_or_a_rank_outside_the_job(flags, message):
    """At start: the step by the config's rules, the rank by the run's checks against the world size."""
    with pytest.raises(ConfigError) as refused:
        check_run(load_job_config(list(flags)), world_size=2, device_type="cpu")
    assert message in str(refused.value)


def test_kill_and_hang_drills_arm_only_on_the_first_torchrun_attempt(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert not FaultDrills(Health(drill="kill", drill_step=2), rank=0, world_size=1).armed
    assert FaultDrills(Health(drill="nan", drill_step=2), rank=0, world_size=1).armed
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert FaultDrills(Health(drill="hang", drill_step=2), rank=0, world_size=1).armed


def test_stall_drill_holds_its_rank_before_the_step_until_a_preemption_signal_arrives(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    drills = FaultDrills(Health(drill="stall", drill_step=3, drill_rank=1), rank=1, world_size=2)
    polls = []

    def signalled() -> bool:
        polls.append(1)
        return len(polls) == 3  # the signal arrives while the rank waits

    drills.before_step(2, signalled)
    assert polls == []  # other steps pass
    drills.before_step(3, signalled)
    assert len(polls) == 3
    assert not FaultDrills(Health(drill="stall", drill_step=3, drill_rank=1), rank=0, world_size=2).armed


def test_context_limit_is_the_flavors_published_context():
    assert llama2_args("debugmodel").context_len == 2048
    assert llama2_args("7B").context_len == 4096
    # Every llama3 flavor carries the Llama 3.1 rotary stretch (as in torchtitan 0.2): 128K tokens.
    assert llama3_args("debugmodel").context_len == 131_072
    assert llama3_args("8B").context_len == 131_072


def test_seq_len_beyond_the_flavor_is_refused_and_validation_counts_only_when_enabled():
    llama2 = ["--model.name", "llama2", "--model.flavor", "debugmodel"]
    with pytest.raises(ConfigError, match="training.seq_len = 8192 is beyond the 2048-token context"):
        resolve(load_job_config([*llama2, "--training.seq_len", "8192"]), 1, "cpu")
    resolve(
        load_job_config([*llama2, "--training.seq_len", "2048", "--validation.seq_len", "4096"]), 1, "cpu"
    )
    with pytest.raises(ConfigError, match="validation.seq_len = 4096 is beyond"):
        resolve(
            load_job_config(
                [*llama2, "--training.seq_len", "2048", "--validation.enable", "--validation.seq_len", "4096"]
            ),
            1,
            "cpu",
        )
