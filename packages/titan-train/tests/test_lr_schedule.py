import pytest

from titan_train.wiring.lr_schedule import lr_factor


def _f(step, **kw):
    args = dict(total_steps=100, warmup_steps=10, decay_ratio=None, decay_type="linear", min_lr_factor=0.0)
    return lr_factor(step, **{**args, **kw})


def test_warmup_is_linear_then_reaches_peak():
    assert _f(1) == pytest.approx(1 / 11)
    assert _f(10) == pytest.approx(10 / 11)
    assert _f(11) == pytest.approx(1 - 1 / 90)


def test_linear_decay_ends_at_min_lr_factor():
    assert _f(100) == pytest.approx(0.0)
    assert _f(100, min_lr_factor=0.1) == pytest.approx(0.1)


def test_warmup_stable_decay_keeps_peak_until_decay_starts():
    assert _f(50, decay_ratio=0.2) == 1.0
    assert _f(80, decay_ratio=0.2) == 1.0
    assert _f(90, decay_ratio=0.2) == pytest.approx(0.5)


@pytest.mark.parametrize("kind,expected", [("linear", 0.5), ("sqrt", 1 - 0.5**0.5), ("cosine", 0.5)])
def test_decay_shapes_at_half_way(kind, expected):
    assert _f(90, decay_ratio=0.2, decay_type=kind) == pytest.approx(expected)
