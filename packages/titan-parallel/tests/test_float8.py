"""float8 training through torchao on this CPU: which layers convert, that it trains, and what is refused."""

import copy

import pytest
import torch
from toy_transformer import SEQ, VOCAB, ToyTransformer, cross_entropy

from titan_parallel import (
    Float8Training,
    ParallelConfigError,
    UnsupportedDeviceError,
    apply_float8,
    float8_tp_plan,
)
from titan_parallel import float8 as titan_float8
from titan_parallel.float8 import check_float8_device


def _overfit(model: torch.nn.Module, steps: int = 10) -> list[float]:
    tokens = torch.randint(0, VOCAB, (8, SEQ + 1), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def fp32_run():
    torch.manual_seed(0)
    model = ToyTransformer()
    return model, _overfit(copy.deepcopy(model))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_converts_block_linears_and_trains_like_float32(fp32_run, recipe, skip_unless_cpu_runs_float8):
    skip_unless_cpu_runs_float8(recipe)
    model, fp32_losses = fp32_run
    model = copy.deepcopy(model)
    apply_float8(model, recipe=recipe)
    kinds = {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert kinds.pop("output") == "Linear"  # skipped by default: the head is sensitive to precision
    assert set(kinds.values()) == {"Float8Linear"}
    losses = _overfit(model)
    assert losses[-1] < 0.5 * losses[0]
    # Measured over these 10 steps (torch 2.15, this CPU): at most 0.68% (tensorwise) and 0.55% (rowwise)
    # from float32 at any step; the bound leaves 3x room.
    assert losses == pytest.approx(fp32_losses, rel=0.02)


def test_float8_leaves_linears_whose_dims_are_not_multiples_of_16_in_high_precision():
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 24))
    apply_float8(model, recipe="tensorwise", skip_fqns=())
    assert [type(m).__name__ for m in model] == ["Float8Linear", "Linear"]


def test_float8_all_gather_needs_the_tensorwise_recipe():
    with pytest.raises(ParallelConfigError, match=r"needs float8\.recipe='tensorwise'"):
        Float8Training(recipe="rowwise", fsdp_all_gather=True)
    with pytest.raises(ParallelConfigError, match="needs the 'tensorwise' recipe"):
        apply_float8(torch.nn.Linear(16, 16), recipe="rowwise", fsdp_all_gather=True)


def test_float8_is_refused_on_devices_without_float8_matmuls():
    check_float8_device("cpu")
    check_float8_device("cuda", capability=(9, 0))
    with pytest.raises(UnsupportedDeviceError, match="compute capability 8.9 or newer .* this one is 8.0"):
        check_float8_device("cuda", capability=(8, 0))
    with pytest.raises(UnsupportedDeviceError, match="not 'mps'"):
        check_float8_device("mps")


def test_float8_rowwise_is_refused_at_setup_where_cpu_matmuls_lack_row_scales(monkeypatch):
    monkeypatch.setattr(titan_float8, "_cpu_scaled_mm_takes_row_scales", lambda: False)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48))
    with pytest.raises(
        UnsupportedDeviceError, match=r"'rowwise' on CPU needs torch._scaled_mm with per-row scales"
    ):
        apply_float8(model, recipe="rowwise", skip_fqns=())
    assert type(model[0]).__name__ == "Linear"  # refused before any layer was swapped
    apply_float8(model, recipe="tensorwise", skip_fqns=())  # the suggested recipe runs on this CPU
    assert type(model[0]).__name__ == "Float8Linear"


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_emulated_float8_matches_float8_matmuls_where_the_cpu_has_them(fp32_run, recipe):
    """Emulation rounds to float8 and multiplies in high precision: it runs on every CPU, even where
    torch 2.11 cannot do rowwise float8 matmuls, and gives the float8 kernels' losses where they run."""
    model, _ = fp32_run
    emulated = copy.deepcopy(model)
    apply_float8(emulated, recipe=recipe, emulate=True)
    assert {m.config.emulate for m in emulated.modules() if type(m).__name__ == "Float8Linear"} == {True}
    emulated_losses = _overfit(emulated, steps=3)
    try:
        check_float8_device("cpu", recipe=recipe)
    except UnsupportedDeviceError:
        return
    real = copy.deepcopy(model)
    apply_float8(real, recipe=recipe)
    assert {m.config.emulate for m in real.modules() if type(m).__name__ == "Float8Linear"} == {False}
    # Measured: tensorwise equal to 1e-6; rowwise 1.6e-4 apart (the kernel accumulates in its own order).
    rtol = {"tensorwise": 1e-5, "rowwise": 1e-3}[recipe]
    torch.testing.assert_close(emulated_losses, _overfit(real, steps=3), rtol=rtol, atol=0)


def test_float8_tp_plan_swaps_the_styles_of_float8_linears_and_their_inputs_only():
    """The model's plain plan, unchanged where a module is not float8 (embedding, output head, a filtered
    linear) and with torchao's float8 styles, same layouts, where it is."""
    model = ToyTransformer()
    apply_float8(model, recipe="tensorwise", skip_fqns=("output", "layers.1.feed_forward.w2"))
    plain = model.tp_plan()
    plan = float8_tp_plan(model, plain)
    kinds = {name: type(style).__name__ for name, style in plan.items()}
    assert kinds["tok_embeddings"] == "RowwiseParallel" and kinds["output"] == "ColwiseParallel"
    assert kinds["layers.0.attention"] == kinds["layers.0.feed_forward"] == "PrepareFloat8ModuleInput"
    assert kinds["layers.0.attention.wq"] == "Float8ColwiseParallel"
    assert kinds["layers.0.attention.wo"] == "Float8RowwiseParallel"
    # One high-precision linear reads the block's hidden state: its input is gathered in high precision.
    assert kinds["layers.1.feed_forward"] == "PrepareModuleInput"
    assert kinds["layers.1.feed_forward.w2"] == "RowwiseParallel"
    assert kinds["layers.1.feed_forward.w1"] == "Float8ColwiseParallel"
    attention = plan["layers.0.attention"]
    assert (attention.input_layouts, attention.desired_input_layouts) == (
        plain["layers.*.attention"].input_layouts,
        plain["layers.*.attention"].desired_input_layouts,
    )
    assert plan["layers.0.attention.wo"].output_layouts == plain["layers.*.attention.wo"].output_layouts


def test_float8_on_cpu_without_emulation_says_in_one_line_that_it_is_slow_and_how_to_emulate(caplog):
    def warnings(emulate: bool) -> list[str]:
        caplog.clear()
        with caplog.at_level("WARNING", logger="titan_parallel.float8"):
            apply_float8(torch.nn.Sequential(torch.nn.Linear(32, 32)), skip_fqns=(), emulate=emulate)
        return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]

    (line,) = warnings(emulate=False)
    assert "reference float8 matmul" in line and "--quantize.linear.float8.emulate" in line
    assert warnings(emulate=True) == []
