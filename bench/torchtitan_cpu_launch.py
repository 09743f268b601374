"""Run torchtitan 0.2.2's own trainer on a CPU, recording each logged step at full precision.

Runs inside torchtitan's environment (bench/parity_torchtitan.py builds it), never Titan's; Titan never
imports this file. torchtitan's arguments pass through untouched:

    torchrun --nproc_per_node 2 bench/torchtitan_cpu_launch.py --model.flavor debugmodel ...

torchtitan 0.2.2 assumes an accelerator in a few places. Each shim below is one such place, patched at
run time, in order, before torchtitan's trainer is imported (the package itself is never edited; a shim
that patches a torchtitan module imports it after the device shim has run); none changes what is
computed, only where it runs or how it is reported, except `shim_grad_norm_float64`, which makes
torchtitan's CPU gradient norm as exact as Titan's (see its docstring). With `PARITY_RECORDS` set, rank 0 appends one JSON
line per logged step (step, loss, grad_norm, lr, and for a mixture-of-experts model the tokens each
router sent to each expert since the last logged step, summed over all ranks) to that file: torchtitan's
console line rounds loss and grad_norm to 4 decimals, too coarse for a 1e-4 relative comparison, and
logs no per-expert counts, which are what finds the first step where two trainers route differently.
"""

from __future__ import annotations

import json
import os
import types

import torch
import torch._utils
import torch.distributed as dist


def shim_device_is_cpu() -> None:
    """torchtitan asks `torch._utils._get_available_device_type()` and falls back to "cuda" when it
    returns None, as it does on a machine without an accelerator: answer "cpu" instead."""
    torch._utils._get_available_device_type = lambda: "cpu"


def shim_cpu_memory_queries() -> None:
    """torchtitan's memory monitor calls device-module queries that `torch.cpu` lacks: give it harmless
    answers (a 16 GiB device, no allocator statistics); only the logged memory figures depend on them."""
    queries = dict(
        get_device_name=lambda *_: "cpu",
        get_device_properties=lambda *_: types.SimpleNamespace(total_memory=1 << 34),
        memory_stats=lambda *_: {},
        reset_peak_memory_stats=lambda *_: None,
        empty_cache=lambda *_: None,
    )
    for name, query in queries.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, query)


def shim_fsdp_sum_reduction() -> None:
    """torchtitan sets FSDP's gradient divide factor to 1 (it scales by the global token count itself);
    FSDP then reduce-scatters with PREMUL_SUM, which gloo rejects. Forcing FSDP's plain-sum reduction
    computes the same sum (the factor is 1) with an op gloo has."""
    from torch.distributed.fsdp import FSDPModule

    set_factor = FSDPModule.set_gradient_divide_factor

    def set_factor_with_sum(self, factor: float) -> None:
        set_factor(self, factor)
        self.set_force_sum_reduction_for_comms(True)

    FSDPModule.set_gradient_divide_factor = set_factor_with_sum


def shim_barrier_device_ids() -> None:
    """torchtitan calls `barrier(device_ids=[device_module.current_device()])`, which on CPU is the
    string "cpu"; device_ids is a CUDA-only hint, so drop ids that are not device indices."""
    barrier = dist.barrier

    def cpu_barrier(*args, device_ids=None, **kwargs):
        if device_ids is not None and not all(isinstance(i, int) for i in device_ids):
            device_ids = None
        return barrier(*args, device_ids=device_ids, **kwargs)

    dist.barrier = cpu_barrier


def shim_histc_integer_counts() -> None:
    """torchtitan's MoE router counts tokens per expert with `torch.histc` on integer expert indices,
    which torch implements only for floating tensors on CPU: count a float copy (exact for indices far
    below 2**24) and return the counts in the input's integer dtype, as CUDA's histc does."""
    histc = torch.histc

    def histc_of_integers(input, *args, **kwargs):
        if input.is_floating_point():
            return histc(input, *args, **kwargs)
        return histc(input.float(), *args, **kwargs).to(input.dtype)

    torch.histc = histc_of_integers


def shim_moe_permute_indices_on_cpu() -> None:
    """torchtitan's grouped-matmul experts (qwen3 keeps them on; deepseek_v3 turns them off without
    sm90) pad each expert's tokens with `generate_permute_indices`, whose default is a Triton kernel
    with no CPU driver: pass its own `use_cpu=True` implementation when the counts live on the CPU."""
    from torchtitan.models.moe import utils

    generate = utils.generate_permute_indices

    def generate_on_cpu(tokens_per_expert_group, *args, use_cpu=False, **kwargs):
        use_cpu = use_cpu or tokens_per_expert_group.device.type == "cpu"
        return generate(tokens_per_expert_group, *args, use_cpu=use_cpu, **kwargs)

    utils.generate_permute_indices = generate_on_cpu


def shim_grad_norm_float64() -> None:
    """On CPU, torch's float32 vector norm accumulates in float32: for the debug model's gradient it is
    off by about 1e-4 relative (measured here), which moves torchtitan's logged grad_norm and its clip
    coefficient. Accumulate each gradient's norm in float64, as Titan's clip_grad_norm_ does on CPU, so
    the comparison measures the trainers rather than the kernel. PARITY_FLOAT32_NORM=1 leaves it out."""
    get_total_norm = torch.nn.utils.get_total_norm

    def total_norm_float64(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if not tensors or tensors[0].device.type != "cpu" or norm_type == float("inf"):
            return get_total_norm(tensors, norm_type, error_if_nonfinite, foreach)
        norms = [torch.linalg.vector_norm(t, norm_type, dtype=torch.float64) for t in tensors]
        return torch.linalg.vector_norm(torch.stack(norms), norm_type).to(tensors[0].dtype)

    torch.nn.utils.get_total_norm = total_norm_float64


def shim_flex_attention_dense_on_cpu() -> None:
    """torchtitan's gpt-oss attends only through `torch.compile(flex_attention)`, which has no backward
    on CPU ("FlexAttention does not support backward on CPU"): on CPU tensors, compute the same
    attention densely instead (the block mask's own `mask_mod` expanded by torch's `create_mask`, an
    explicit softmax and its natural-log log-sum-exp), which autograd differentiates. Its forward equals
    eager flex_attention's to 2.4e-7 (lse) on causal and sliding-window masks with grouped-query heads."""
    from torch.nn.attention.flex_attention import create_mask
    from torchtitan.models.attention import FlexAttentionWrapper

    compiled = FlexAttentionWrapper._compiled_flex_attn

    def dense_attention(q, k, v, *, block_mask=None, scale=None, enable_gqa=False, return_lse=False, **kw):
        if q.device.type != "cpu" or kw:
            return compiled(
                q,
                k,
                v,
                block_mask=block_mask,
                scale=scale,
                enable_gqa=enable_gqa,
                return_lse=return_lse,
                **kw,
            )
        if enable_gqa and k.shape[1] != q.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
        if block_mask is not None:
            batch = block_mask.kv_num_blocks.shape[0]
            mask = create_mask(block_mask.mask_mod, batch, 1, *block_mask.seq_lengths, device=q.device)
            scores = scores.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        out = torch.softmax(scores, dim=-1) @ v
        return (out, lse) if return_lse else out

    FlexAttentionWrapper._compiled_flex_attn = dense_attention


def shim_block_masks_on_cpu() -> None:
    """torchtitan builds flex attention's block masks with `torch.compile(create_block_mask)` and no
    device, so torch's default "cuda" ("Found no NVIDIA driver"): build them eagerly on the CPU, the same
    mask (`shim_flex_attention_dense_on_cpu` reads only its `mask_mod` and lengths)."""
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models import attention

    def create_on_cpu(*args, **kwargs):
        kwargs.setdefault("device", "cpu")
        return create_block_mask(*args, **kwargs)

    attention._compiled_create_block_mask = create_on_cpu


def shim_router_gate_bias_initialised() -> None:
    """torchtitan 0.2.2's router initialises its gate's weight but not the bias gpt-oss gives it
    (`TokenChoiceTopKRouter.init_weights`), so a seed checkpoint holds whatever memory held: measured
    here, -1e9 and NaN in the debug model's biases, a NaN loss from step 1 and every token routed to
    the same experts. Draw the bias like the weight (as Titan does); only the seed checkpoint's values
    change, which both trainers then load."""
    from torchtitan.models.moe.moe import TokenChoiceTopKRouter
    from torchtitan.models.utils import trunc_normal_

    init = TokenChoiceTopKRouter.init_weights

    def init_with_bias(self, init_std: float):
        init(self, init_std)
        if self.gate.bias is not None:
            trunc_normal_(self.gate.bias, mean=0.0, std=init_std)

    TokenChoiceTopKRouter.init_weights = init_with_bias


def shim_gpt_oss_blocks_in_float32() -> None:
    """torchtitan 0.2.2's gpt-oss casts every block to bfloat16 as it builds it, whatever
    mixed_precision_param says (`TransformerBlock(...).to(torch.bfloat16)` in gpt_oss/model/model.py):
    its weights and AdamW state are bfloat16, and on one process float32 stops at the first linear
    ("mat1 and mat2 must have the same dtype"). With PARITY_GPT_OSS_FLOAT32=1 (the parity bench sets it)
    the blocks stay in the default dtype, so the float32 comparison measures the trainers, not bfloat16
    weights. It changes what torchtitan computes; the checkpoint fixture (tests/fixtures/torchtitan_moe)
    is written without it, as torchtitan trains."""
    if os.environ.get("PARITY_GPT_OSS_FLOAT32") != "1":
        return
    from torchtitan.models.gpt_oss.model.model import GptOssModel

    build = GptOssModel.__init__

    def build_in_default_dtype(self, model_args):
        build(self, model_args)
        for block in self.layers.values():
            block.to(torch.get_default_dtype())

    GptOssModel.__init__ = build_in_default_dtype


def _count_routed_tokens() -> dict[int, torch.Tensor]:
    """Sum each router's tokens per expert (its third output) into the returned dict, keyed by router in
    the order the routers first run (layer order). A recomputing activation checkpoint would count twice:
    the parity runs use `--activation_checkpoint.mode none`."""
    from torchtitan.models.moe.moe import TokenChoiceTopKRouter

    routed: dict[int, torch.Tensor] = {}
    forward = TokenChoiceTopKRouter.forward

    def counting_forward(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        counts = out[2].detach().to(torch.float64)
        if id(self) in routed:
            routed[id(self)] += counts
        else:
            routed[id(self)] = counts.clone()
        return out

    TokenChoiceTopKRouter.forward = counting_forward
    return routed


def _take_counts(routed: dict[int, torch.Tensor]) -> list[list[float]] | None:
    """Every layer's routed tokens per expert since the last call, summed over all ranks (every rank
    calls it: torchtitan logs on every rank), then reset; None for a model without experts."""
    if not routed:
        return None
    counts = torch.stack(list(routed.values()))
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(counts)
    for layer in routed.values():
        layer.zero_()
    return counts.tolist()


def record_steps(path: str) -> None:
    """Rank 0 appends {step, loss, grad_norm, lr, expert_counts} to `path` each time torchtitan logs a step."""
    from torchtitan.components.metrics import MetricsProcessor

    log = MetricsProcessor.log
    routed = _count_routed_tokens()

    def log_and_record(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        counts = _take_counts(routed)
        if os.environ.get("RANK", "0") == "0":
            lr = (extra_metrics or {}).get("lr")
            record = dict(step=step, loss=float(global_avg_loss), grad_norm=float(grad_norm), lr=lr)
            if counts is not None:
                record["expert_counts"] = counts
            with open(path, "a", encoding="utf-8") as out:
                out.write(json.dumps(record) + "\n")
        return log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)

    MetricsProcessor.log = log_and_record


SHIMS = (
    shim_device_is_cpu,
    shim_cpu_memory_queries,
    shim_fsdp_sum_reduction,
    shim_barrier_device_ids,
    shim_histc_integer_counts,
    shim_moe_permute_indices_on_cpu,
    shim_grad_norm_float64,
    shim_flex_attention_dense_on_cpu,
    shim_block_masks_on_cpu,
    shim_router_gate_bias_initialised,
    shim_gpt_oss_blocks_in_float32,
)


def main() -> None:
    for shim in SHIMS:
        if not (shim is shim_grad_norm_float64 and os.environ.get("PARITY_FLOAT32_NORM") == "1"):
            shim()
    if os.environ.get("PARITY_RECORDS"):
        record_steps(os.environ["PARITY_RECORDS"])
    # Imported only now: torchtitan reads the device type when its modules load.
    from torchtitan.train import Trainer
    from torchtitan.train import main as torchtitan_main

    torchtitan_main(Trainer)


if __name__ == "__main__":
    main()
