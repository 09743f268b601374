"""FSDP2 with bf16 parameters and fp32 gradient reduction, on one GPU over a real NCCL group.

titan-parallel's `parallelize` applies FSDP only when parameters are sharded over more than one
rank, so this test calls its FSDP helper, `apply_fsdp`, on a one-rank mesh directly.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from titan_parallel import apply_fsdp

pytestmark = pytest.mark.gpu

STEPS = 3
# FSDP's bf16 parameters run every op in bf16 (norms, rotary, residuals too); autocast runs only
# matmuls in bf16. The two differ by bf16 rounding, not more: on an H100 (torch 2.11) the losses by
# 1.2e-4 relative and the worst parameter gradient by 1.2e-2.
LOSS_TOLERANCE, GRAD_TOLERANCE = 1e-3, 3e-2


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def test_fsdp_bf16_params_fp32_reduce_trains_like_autocast(
    one_rank_nccl_group, build_model, token_batch, report, rel_error
):
    mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("dp_shard",))

    def shard(model):
        apply_fsdp(
            model, model.parallel_blocks(), mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )

    fsdp = build_model(transform=shard, max_seq_len=256)
    plain = build_model(max_seq_len=256)
    for name, param in fsdp.named_parameters():
        assert isinstance(param, DTensor) and param.dtype == torch.float32, (name, type(param), param.dtype)

    seen: dict[str, torch.dtype] = {}

    def record_dtypes(module, args):
        seen.update(weight=module.weight.dtype, input=args[0].dtype)

    fsdp.layers["0"].attention.wq.register_forward_pre_hook(record_dtypes)
    fsdp_opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-3)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    losses, ref_losses, grad_errors = [], [], {}
    for step in range(STEPS):
        inputs, labels = token_batch(4, 256, seed=step)
        logits = fsdp(inputs)
        loss = _loss(logits, labels)
        loss.backward()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ref_logits = plain(inputs)
        ref_loss = _loss(ref_logits, labels)
        ref_loss.backward()
        if step == 0:
            assert logits.dtype == torch.bfloat16
            assert seen == {"weight": torch.bfloat16, "input": torch.bfloat16}
            ref_grads = dict(plain.named_parameters())
            for name, param in fsdp.named_parameters():
                grad = param.grad
                assert isinstance(grad, DTensor) and grad.dtype == torch.float32, (
                    name,
                    type(grad),
                    grad.dtype,
                )
                grad_errors[name] = rel_error(grad.full_tensor(), ref_grads[name].grad)
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
        for opt in (fsdp_opt, plain_opt):
            opt.step()
            opt.zero_grad(set_to_none=True)

    loss_errors = [abs(a - b) / b for a, b in zip(losses, ref_losses, strict=True)]
    worst = max(grad_errors, key=grad_errors.get)
    report(max_loss_rel=max(loss_errors), worst_grad=grad_errors[worst], worst_grad_param=worst)
    for name, param in fsdp.named_parameters():
        assert param.dtype == torch.float32, name  # the optimizer kept updating fp32 shards
    assert max(loss_errors) < LOSS_TOLERANCE, (losses, ref_losses)
    assert grad_errors[worst] < GRAD_TOLERANCE, f"{worst}: {grad_errors[worst]:.3g}"
