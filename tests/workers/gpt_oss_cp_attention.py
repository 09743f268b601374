"""torchrun worker (2 ranks, gloo): gpt-oss attention under context parallelism against one process.

`gpt_oss_cp_attention.py OUT.json`: for each case (sequence length around the window, load balancing
on or off) a windowed and a full gpt-oss attention layer (random weights, biases and sinks, the same
on every rank) run over a random input sharded by `titan_parallel.context_parallel_ctx`, the real
path: the model part receives a `SequenceShard`, gathers keys and values and masks by global positions.
Each rank's outputs and input gradients are put back at their global positions and every parameter
gradient is summed over the group; rank 0 writes, per case, the largest difference of each from
(a) the same layers in one process and (b) a direct float64 softmax written here (every allowed key
listed position by position, the sink added to the denominator).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from titan_models.gpt_oss import GptOssAttention, build_gpt_oss_masks, gpt_oss_args, gpt_oss_rotary_table
from titan_models.half_split_rotary import apply_rotary_half_split
from titan_parallel import context_parallel_ctx

WINDOW = 16
# (seq_len, load_balance): shorter than, equal to and past the window, and long enough that load-balanced
# chunks (seq / 4) sit more than a window apart.
CASES = [(12, True), (16, True), (20, True), (64, True), (64, False)]


class TwoAttentions(nn.Module):
    """Layer 0 (windowed) and layer 1 (full) side by side, masked as `GptOssModel` masks them."""

    def __init__(self, args):
        super().__init__()
        self.args = args
        self.layers = nn.ModuleList([GptOssAttention(args, 0), GptOssAttention(args, 1)])
        self.shard = None

    def set_sequence_shard(self, shard) -> None:
        self.shard = shard

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        masks = build_gpt_oss_masks(self.args, None, x.shape[1], x.device, self.shard)
        return torch.stack([layer(x, freqs_cis, masks) for layer in self.layers])


def direct_reference(attention: GptOssAttention, x, freqs_cis, window: int | None) -> torch.Tensor:
    """exp(s_ij) / (exp(sink) + sum over allowed j of exp(s_ij)), in float64, query by query."""
    a = attention.double()
    bs, s, _ = x.shape
    q = a.wq(x).view(bs, s, -1, a.head_dim)
    k = a.wk(x).view(bs, s, -1, a.head_dim)
    v = a.wv(x).view(bs, s, -1, a.head_dim)
    q, k = apply_rotary_half_split(q, k, freqs_cis)
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    out = torch.zeros_like(q)
    for i in range(s):
        keys = range(0 if window is None else max(0, i - window + 1), i + 1)
        for h in range(q.shape[2]):
            logits = torch.stack([(q[:, i, h] * k[:, j, h]).sum(-1) for j in keys]) * a.scale  # (keys, batch)
            top = torch.maximum(logits.amax(0), a.sinks[h].double())
            weights = torch.exp(logits - top)
            denominator = weights.sum(0) + torch.exp(a.sinks[h].double() - top)
            values = torch.stack([v[:, j, h] for j in keys])  # (keys, batch, head_dim)
            out[:, i, h] = (weights[..., None] * values).sum(0) / denominator[:, None]
    return a.wo(out.reshape(bs, s, -1))


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    args = replace(
        gpt_oss_args("debugmodel"),
        dim=32,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        max_seq_len=64,
        sliding_window_size=WINDOW,
        rope_factor=4.0,
        original_seq_len=16,
        attn_backend="sdpa",
    )
    results = {}
    for seq_len, load_balance in CASES:
        torch.manual_seed(seq_len)
        model = TwoAttentions(replace(args, max_seq_len=seq_len))
        for p in model.parameters():
            nn.init.normal_(p, std=0.3)  # sinks and biases too: every parameter random
        freqs = gpt_oss_rotary_table(replace(args, max_seq_len=seq_len))
        x_full = torch.randn(2, seq_len, args.dim)
        grad_out = torch.randn(2, 2, seq_len, args.dim)

        # One process.
        x1 = x_full.clone().requires_grad_()
        one = model(x1, freqs)
        one.backward(grad_out)
        one_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()

        # Context parallel 2: the input, the rotary table and the global positions sharded alike.
        x_buf, freqs_buf, grad_buf = x_full.clone(), freqs.clone(), grad_out.clone()
        with context_parallel_ctx(
            mesh,
            [x_buf, freqs_buf, grad_buf],
            [1, 0, 2],
            no_restore_buffers={x_buf, grad_buf},
            load_balance=load_balance,
            models=[model],
        ):
            positions = model.shard.positions.clone()
            x_local = x_buf.clone().requires_grad_()
            local = model(x_local, freqs_buf)
            local.backward(grad_buf)
        assert model.shard is None, "the shard must be withdrawn on exit"
        everywhere = [torch.empty_like(positions) for _ in range(2)]
        dist.all_gather(everywhere, positions)
        order = torch.cat(everywhere)
        cp_out = torch.empty_like(one)
        cp_out[:, :, order] = torch.cat(_gathered(local.detach(), 2), dim=2)
        cp_x_grad = torch.empty_like(x_full)
        cp_x_grad[:, order] = torch.cat(_gathered(x_local.grad, 1), dim=1)
        cp_grads = {}
        for name, p in model.named_parameters():
            grad = p.grad if p.grad is not None else torch.zeros_like(p)  # a parameter the step never reached
            dist.all_reduce(grad)
            cp_grads[name] = grad

        if rank != 0:  # only rank 0 writes the results
            continue
        with torch.no_grad():
            ref = torch.stack(
                [
                    direct_reference(model.layers[0], x_full.double(), freqs, WINDOW),
                    direct_reference(model.layers[1], x_full.double(), freqs, None),
                ]
            )
        results[f"seq{seq_len}_{'balanced' if load_balance else 'contiguous'}"] = {
            "out_vs_one_process": _diff(cp_out, one),
            "out_vs_direct": _diff(cp_out, ref),
            "x_grad_vs_one_process": _diff(cp_x_grad, x1.grad),
            "param_grads_vs_one_process": {n: _diff(cp_grads[n], g) for n, g in one_grads.items()},
            "positions_rank0": everywhere[0].tolist(),
        }
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def _gathered(tensor: torch.Tensor, dim: int) -> list[torch.Tensor]:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return parts


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to b's largest magnitude."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / max(b.abs().max().item(), math.ulp(1.0)))


if __name__ == "__main__":
    main(sys.argv[1])
