"""The resolve step: what a run is, worked out once from its config, world size and device.

`plan = resolve(config, world_size, device_type)` reads the model family from the registry and its
args once (for a `from_hf` flavor or a Hugging Face checkpoint to load, from its `config.json`), and
derives from them and the config the facts every consumer needs: the parallel degrees, the sequence
length the model is built for, gradient accumulation, the loss, the layout settings and the
parameter counts. Training, the dry run, the memory estimate and trace, `titan-train check`,
generate/eval and the Hugging Face export take the plan instead of re-deriving any of it, so a fact
changes in one place and every one of them sees the change (tests/test_plan.py).

Every rule that needs these facts is checked here, all at once, so a bad layout is one error listing
every problem, before a process group is joined.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.torch_version import TorchVersion

from titan_models import ModelError
from titan_parallel import (
    ParallelConfigError,
    ParallelDims,
    blocks_of,
    expert_sizes,
    moe_layers_of,
    pipeline_stages,
)
from titan_train.config.schema import JobConfig
from titan_train.config.sft_section import is_chat, is_preference
from titan_train.config.validate import family_takes_positions
from titan_train.errors import ConfigError
from titan_train.family_args import (
    KeepsPositionFunction,
    context_parallel_refusal,
    context_parallel_rotate_methods,
)
from titan_train.fault_tolerance.semi_sync import fragment_problems
from titan_train.objectives.registry import objective_name
from titan_train.registry import ModelFamily, get_model_family
from titan_train.run_plan import ParamCounts, RunPlan
from titan_train.step.muon_after_step import qk_clip_problems
from titan_train.step.optimizer_in_backward import step_in_backward_problems
from titan_train.vllm_serving import vllm_problems
from titan_train.wiring.hf_interop import export_dtype, hf_export_problems, model_args
from titan_train.wiring.lora import LORA_CONVERTER, lora_target_problems
from titan_train.wiring.loss import build_loss_fn
from titan_train.wiring.moe import balance_problems, moe_run_args
from titan_train.wiring.mtp import MTPLoss, mtp_problems, mtp_run_args
from titan_train.wiring.parallelism import build_parallel_dims, parallel_options
from titan_train.wiring.precision import compute_dtype, dtype_of
from titan_train.wiring.qlora import qlora_problems


def model_seq_len(config: JobConfig) -> int:
    """Positions the model is built for: the longer of training.seq_len and, when validation runs,
    validation.seq_len (FLOPs and memory still count training.seq_len)."""
    if config.validation.enable:
        return max(config.training.seq_len, config.validation.seq_len)
    return config.training.seq_len


def with_positions(args: Any, positions: int) -> Any:
    """`args` with a rotary table of `positions` rows; a family whose function depends on the table's
    length (its args have `with_positions`) keeps the function the args compute now."""
    if isinstance(args, KeepsPositionFunction):
        return args.with_positions(positions)
    return replace(args, max_seq_len=positions)


def run_model_args(config: JobConfig, family: ModelFamily, **overrides) -> Any:
    """The run's model args: the flavor (or Hugging Face config) as training.seq_len sets it, so a
    function that depends on the sequence length (YaRN) is training's, then a rotary table
    long enough for validation too (`model_seq_len`). With the run's MoE settings."""
    args = model_args(config, family, max_seq_len=config.training.seq_len, **overrides)
    args = mtp_run_args(config, moe_run_args(config, args))
    seq_len = model_seq_len(config)
    return with_positions(args, seq_len) if seq_len > config.training.seq_len else args


def resolve(config: JobConfig, world_size: int, device_type: str = "cuda") -> RunPlan:
    """The plan of `config` on `world_size` ranks of `device_type`; a ConfigError naming every problem."""
    family = get_model_family(config.model.name)
    seq_len = model_seq_len(config)
    args = run_model_args(config, family)
    export_problems = hf_export_problems(config, family, args)
    _check_context(config, args)
    dims = build_parallel_dims(config, world_size)
    param_dtype = compute_dtype(config, torch.device(device_type)) if dims.fsdp_enabled else torch.float32
    options = parallel_options(config, param_dtype, dtype_of(config.training.mixed_precision_reduce))
    problems, grad_accum_steps, objective = export_problems, 1, "next_token"
    t, per_step = config.training, config.training.local_batch_size * dims.dp_degree
    if t.global_batch_size > 0 and t.global_batch_size % per_step:
        problems.append(
            f"config: training.global_batch_size ({t.global_batch_size}) must be a multiple of "
            f"local_batch_size ({t.local_batch_size}) * data-parallel degree ({dims.dp_degree}) = {per_step}"
        )
    elif t.global_batch_size > 0:
        grad_accum_steps = t.global_batch_size // per_step
    try:
        objective = objective_name(config)
    except ConfigError as err:
        problems.append(str(err))
    try:
        dims.check_model(
            n_layers=args.n_layers,
            n_heads=args.n_heads,
            n_kv_heads=args.kv_heads,
            seq_len=config.training.seq_len,
            vocab_size=args.vocab_size,
            sequence_parallel=options.tensor_parallel.sequence_parallel,
        )
    except ParallelConfigError as err:
        problems.append(str(err))
    # For its parameter counts and pipeline units. The tokenizer's eos_id (which block-causal masks
    # need, and which the builder sets) changes no parameter: a stand-in until then.
    with torch.device("meta"):
        model = family.build(counting_args(args))
    problems.extend(_expert_problems(config, dims, model))
    problems.extend(_context_parallel_problems(config, dims, args))
    problems.extend(_gathered_context_parallel_problems(config, dims, args))
    problems.extend(mtp_problems(config, dims, args))
    problems.extend(moe_torch_problems(config, dims, bool(moe_layers_of(model)), torch.__version__))
    problems.extend(lora_target_problems(config, model))
    problems.extend(qlora_problems(config, dims, model))
    problems.extend(balance_problems(config, args))
    problems.extend(qk_clip_problems(config, model))
    problems.extend(fragment_problems(config, model))
    problems.extend(step_in_backward_problems(config, grad_accum_steps))
    problems.extend(vllm_problems(config, family, args, device_type, export_dtype(config)))
    if dims.tp > 1:  # a family without a tensor-parallel plan says so when asked for it
        try:
            model.tp_plan()
        except ModelError as err:
            problems.append(f"parallelism.tensor_parallel_degree({dims.tp}): {err}")
    if dims.pp > 1:  # the stages build_pipeline would cut, checked without building them
        try:
            pipeline_stages(model.pipeline_units(), list(blocks_of(model)), dims.pp, options.pipeline)
        except (ParallelConfigError, ModelError) as err:
            problems.append(str(err))
    if problems:
        raise ConfigError("; ".join(problems))
    return RunPlan(
        config=config,
        world_size=world_size,
        device_type=device_type,
        family=family,
        model_args=args,
        seq_len=seq_len,
        dims=dims,
        grad_accum_steps=grad_accum_steps,
        loss_fn=_with_mtp(build_loss_fn(config, family), config, args),
        options=options,
        params=ParamCounts.of(model, family),
        num_streams=config.training.dataloader.num_streams,
        steps=config.training.steps,
        objective=objective,
    )


def one_process_plan(config: JobConfig, device_type: str, *, adapters: bool = True) -> RunPlan:
    """The plan of `config`'s model held whole by one process, for generation, evaluation and reading a
    checkpoint back: the run's family, shape and LoRA options (without them where `adapters` is false: a
    merged Hugging Face export holds none), every degree 1, and none of what changes how training computes
    rather than what (compile, activation checkpointing, float8/MX layers, the training dtype)."""
    one = copy.deepcopy(config)
    p = one.parallelism
    p.data_parallel_replicate_degree = p.data_parallel_shard_degree = p.context_parallel_degree = 1
    p.tensor_parallel_degree = p.pipeline_parallel_degree = 1
    p.expert_parallel_degree = p.expert_tensor_parallel_degree = 1
    one.compile.enable = False
    one.activation_checkpoint.mode = "none"
    one.training.dtype = "float32"
    one.training.enable_cpu_offload = False
    lora = LORA_CONVERTER in config.model.converters and adapters
    one.model.converters = [LORA_CONVERTER] if lora else []
    if not lora:
        one.lora.quantize_base = ""  # no adapters: nothing to quantise under
    return resolve(one, 1, device_type)


def _with_mtp(loss_fn: Any, config: JobConfig, args: Any) -> Any:
    """The loss with the MTP depths' added, for a model that has them (`titan_train.wiring.mtp`)."""
    if config.model.num_mtp_layers == 0:
        return loss_fn
    return MTPLoss(loss_fn, config.model.mtp_loss_weight)


def counting_args(args: Any) -> Any:
    """`args` buildable before the tokenizer is known: a model that packs documents (block_causal) may
    refuse to be built without its eos_id (an MLA family does), which the trainer sets from the
    tokenizer; parameter counts and pipeline units do not depend on its value."""
    return replace(args, eos_id=0) if args.eos_id is None else args


def _expert_problems(config: JobConfig, dims: ParallelDims, model: nn.Module) -> list[str]:
    """What stops this model's experts from being split as `[parallelism]` asks: no experts to split,
    a number of experts that the ep ranks cannot share evenly, a hidden dim that etp (or tp) cannot split."""
    m = config.model
    layers = moe_layers_of(model)
    if not layers:
        if dims.ep > 1 or dims.etp > 1:
            return [
                f"parallelism.expert_parallel_degree({dims.ep})/expert_tensor_parallel_degree({dims.etp}): "
                f"{m.name} {m.flavor} has no experts to split; set both to 1 or pick a mixture-of-experts flavor"
            ]
        return []
    experts = next(iter(layers.values())).experts
    num_experts, hidden = expert_sizes(experts)  # titan_parallel.protocols.HasMoELayers
    try:
        dims.check_model(num_experts=num_experts, expert_hidden_dim=hidden)
    except ParallelConfigError as err:
        return [str(err)]
    return []


# Expert parallelism under a pipeline and compiled MoE layers are tested on torch 2.15 (the lock's), where
# they train as one process does, and drift from it on 2.11 (the packages' floor; issue 38); the versions
# between are untested, so they are refused too.
MOE_TORCH_FLOOR = (2, 15)


def moe_torch_problems(config: JobConfig, dims: ParallelDims, has_experts: bool, version: str) -> list[str]:
    """Refuse, on a torch older than MOE_TORCH_FLOOR, the MoE layouts that drift from one process there."""
    if not has_experts or TorchVersion(version) >= MOE_TORCH_FLOOR:
        return []
    floor = ".".join(map(str, MOE_TORCH_FLOOR))
    problems = []
    if dims.ep > 1 and dims.pp > 1:
        problems.append(
            f"parallelism: expert_parallel_degree({dims.ep}) with pipeline_parallel_degree({dims.pp}) needs "
            f"torch >= {floor} (this is torch {version}; tested on {floor}, it drifts from one process on 2.11); "
            "upgrade torch or drop one of the two"
        )
    if config.compile.enable and "model" in config.compile.components:
        problems.append(
            f"compile.enable: a compiled mixture-of-experts model needs torch >= {floor} (this is torch "
            f"{version}; tested on {floor}, it drifts from eager on 2.11); upgrade torch or remove 'model' from "
            "compile.components"
        )
    return problems


def _gathered_context_parallel_problems(config: JobConfig, dims: ParallelDims, args: Any) -> list[str]:
    """Context parallelism over packed documents (chat rows, block-causal text) or with ptrr deals each row
    to the ranks and gathers keys (`titan_parallel.gathered_context_parallel`): the family must take
    per-token positions, and the gather is the only rotation it honours."""
    p = config.parallelism
    rows = config.training
    packed = is_chat(rows) or is_preference(rows) or args.attn_mask_type == "block_causal"
    if dims.cp == 1 or not (packed or p.context_parallel_load_balancer == "ptrr"):
        return []
    what = "packed documents" if packed else "the ptrr load balancer"
    m, degree = config.model, f"parallelism.context_parallel_degree({dims.cp})"
    if not family_takes_positions(m.name):
        return [
            f"{degree} over {what}: {m.name} {m.flavor} builds its own attention masks, which cannot be dealt "
            "per row; pick a flavor with attn_mask_type 'causal' on unpacked rows and load balancer "
            "'headtail', or set context_parallel_degree = 1"
        ]
    if p.context_parallel_rotate_method != "allgather":
        return [
            f"parallelism.context_parallel_rotate_method = {p.context_parallel_rotate_method!r}: context "
            f"parallelism over {what} gathers every rank's keys and values; set it to 'allgather'"
        ]
    if dims.pp > 1:
        return [
            f"{degree} over {what} with pipeline_parallel_degree({dims.pp}): the stages' dealt positions "
            "are not carried yet; use data or tensor parallelism beside context parallelism"
        ]
    return []


def _context_parallel_problems(config: JobConfig, dims: ParallelDims, args: Any) -> list[str]:
    """A family whose attention context parallelism cannot split says why (`context_parallel_refusal` of its
    args), and one that computes its own attention names the rotate methods it honours
    (`context_parallel_rotate_methods`; both `titan_train.family_args`)."""
    refusal = context_parallel_refusal(args)
    if dims.cp > 1 and refusal:
        m = config.model
        return [f"parallelism.context_parallel_degree({dims.cp}): {m.name} {m.flavor} {refusal}"]
    methods = context_parallel_rotate_methods(args)
    rotate = config.parallelism.context_parallel_rotate_method
    if dims.cp > 1 and methods and rotate not in methods:
        m = config.model
        return [
            f"parallelism.context_parallel_rotate_method = {rotate!r}: {m.name} {m.flavor} gathers the whole "
            f"sequence's keys and values for its own attention under context parallelism; set it to "
            f"{' or '.join(map(repr, methods))}"
        ]
    return []


def _check_context(config: JobConfig, args: Any) -> None:
    """Refuse a training (or validation) seq_len beyond the flavor's context, naming the limit and the fix.

    The model's rotary table is sized to the run's longest sequence, so nothing would fail: the model
    would train on positions its flavor was never built for (and a typo such as 81920 for 8192 would
    exhaust memory deep inside attention)."""
    m, limit = config.model, args.context_len
    lengths = [("training.seq_len", config.training.seq_len)]
    if config.validation.enable:
        lengths.append(("validation.seq_len", config.validation.seq_len))
    for name, value in lengths:
        if value > limit:
            raise ConfigError(
                f"config: {name} = {value} is beyond the {limit}-token context of {m.name} {m.flavor}; "
                f"set {name} to at most {limit}, or pick a model.flavor with a longer context"
            )
