import logging
from typing import Any

import pytest
import torch
from torch import nn

from titan_ckpt import Checkpointer, CheckpointError, ModelState, OptimizerState, complete_steps


class Counter:
    def __init__(self):
        self.value = 0

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


def _run(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer


def _train(model, optimizer, steps):
    gen = torch.Generator().manual_seed(7)
    for _ in range(steps):
        loss = model(torch.randn(4, 8, generator=gen)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _states(model, optimizer, counter):
    return {"model": ModelState([model]), "optimizer": OptimizerState([model], [optimizer]), "counter": counter}


def test_save_then_load_restores_model_optimizer_and_objects(tmp_path, single_process_group):
    model, opt = _run()
    _train(model, opt, 3)
    counter = Counter()
    counter.value = 3
    Checkpointer(tmp_path / "ckpt", _states(model, opt, counter), interval=1).save(3)

    fresh_model, fresh_opt = _run(seed=1)
    fresh_counter = Counter()
    step = Checkpointer(tmp_path / "ckpt", _states(fresh_model, fresh_opt, fresh_counter), interval=1).load()
    assert step == 3 and fresh_counter.value == 3
    for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(a, b)
    _train(model, opt, 2)
    _train(fresh_model, fresh_opt, 2)
    for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_saves_at_interval_and_keeps_latest_k(tmp_path, single_process_group):
    model, opt = _run()
    ckpt = Checkpointer(tmp_path, _states(model, opt, Counter()), interval=2, keep_latest_k=2)
    saved = [step for step in range(1, 11) if ckpt.maybe_save(step)]
    assert saved == [2, 4, 6, 8, 10]
    assert complete_steps(tmp_path) == [8, 10]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-10", "step-8"]


def test_partial_folder_from_a_crash_is_skipped_and_removed(tmp_path, single_process_group, caplog):
    model, opt = _run()
    ckpt = Checkpointer(tmp_path, _states(model, opt, Counter()), interval=1)
    ckpt.save(1)
    partial = tmp_path / "step-2.partial"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half written")
    with caplog.at_level(logging.WARNING):
        assert ckpt.load() == 1
    assert "step-2.partial" in caplog.text
    assert not partial.exists()


def test_no_checkpoint_means_fresh_start(tmp_path, single_process_group, caplog):
    model, opt = _run()
    with caplog.at_level(logging.INFO):
        assert Checkpointer(tmp_path / "none", _states(model, opt, Counter()), interval=1).load() is None
    assert "fresh start" in caplog.text


def test_bad_interval_is_refused():
    with pytest.raises(CheckpointError, match="interval must be >= 1, got 0"):
        Checkpointer("x", {}, interval=0)
