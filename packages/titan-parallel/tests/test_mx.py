"""MXFP8 training through torchao: which layers convert, that the emulated recipe trains, what is refused."""

import copy

import pytest
import torch
from toy_transformer import SEQ, VOCAB, ToyTransformer, cross_entropy

from titan_parallel import (
    Float8Training,
    MXTraining,
    ParallelConfigError,
    ParallelOptions,
    UnsupportedDeviceError,
    apply_mx,
)
from titan_parallel.mx import check_mx_device, mx_available

needs_mx = pytest.mark.skipif(
    not mx_available(), reason="MXFP8 training needs torchao >= 0.18 (the floor run has 0.17)"
)


def _train(model: torch.nn.Module, steps: int = 5) -> list[float]:
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


@needs_mx
@pytest.mark.parametrize("recipe", ["mxfp8_emulated", "mxfp8_emulated_rceil"])
def test_emulated_mx_converts_block_linears_and_trains_like_float32(recipe):
    torch.manual_seed(0)
    model = ToyTransformer()
    mx = apply_mx(copy.deepcopy(model), recipe=recipe, dim1_cast_kernel="torch", device_type="cpu")
    kinds = {name: type(m).__name__ for name, m in mx.named_modules() if isinstance(m, torch.nn.Linear)}
    assert kinds.pop("output") == "Linear"  # skipped by default
    assert set(kinds.values()) == {"MXLinear"}
    assert {str(m.dim1_cast_kernel) for m in mx.modules() if type(m).__name__ == "MXLinear"} == {
        "MXFP8Dim1CastKernelChoice.TORCH"
    }
    losses, fp32 = _train(mx), _train(model)
    assert losses != fp32  # the casts round
    # Measured over these 5 steps: at most 0.37% (floor scales) and 0.26% (rceil) from float32; 2.7x room.
    assert losses == pytest.approx(fp32, rel=0.01)


def test_mx_recipes_with_mx_kernels_are_refused_without_mx_matmuls():
    check_mx_device("cuda", capability=(10, 0), recipe="mxfp8_cublas")
    check_mx_device("cpu", recipe="mxfp8_emulated")
    with pytest.raises(UnsupportedDeviceError, match=r"this run is on a CUDA GPU of compute capability 9\.0"):
        check_mx_device("cuda", capability=(9, 0), recipe="mxfp8_rceil")
    model = torch.nn.Sequential(torch.nn.Linear(32, 64))
    with pytest.raises(UnsupportedDeviceError, match="this run is on cpu; use an emulated recipe"):
        apply_mx(model, recipe="mxfp8_cublas", device_type="cpu")
    assert type(model[0]).__name__ == "Linear"  # refused before any layer was swapped


def test_mx_settings_are_checked():
    with pytest.raises(ParallelConfigError, match=r"mx\.recipe='mxfp4_cutlass' is unknown"):
        MXTraining(recipe="mxfp4_cutlass")
    with pytest.raises(ParallelConfigError, match="both convert the linear layers"):
        ParallelOptions(mx=MXTraining("mxfp8_emulated"), float8=Float8Training("tensorwise"))
    with pytest.raises(ParallelConfigError, match=r"mx\.dim1_cast_kernel='cutedsl' is unknown"):
        MXTraining(dim1_cast_kernel="cutedsl")


@pytest.mark.skipif(mx_available(), reason="this torchao has MXFP8 training")
def test_mx_on_a_torchao_without_it_is_refused_in_one_line():
    with pytest.raises(UnsupportedDeviceError, match=r"MXFP8 training needs torchao >= 0\.18"):
        apply_mx(ToyTransformer(), recipe="mxfp8_emulated", dim1_cast_kernel="torch", device_type="cpu")
