"""Model-agnostic parallelisms: the device mesh and the transforms that apply each parallelism."""

from titan_parallel.activation_checkpoint import ActivationCheckpointing, apply_ac
from titan_parallel.compile import Compile, apply_compile
from titan_parallel.context_parallel import ContextParallelOptions, context_parallel_ctx
from titan_parallel.ddp import apply_ddp
from titan_parallel.errors import ModelDescriptionError, ParallelConfigError, UnsupportedDeviceError
from titan_parallel.expert_parallel import (
    ExpertParallel,
    TensorParallelExperts,
    apply_expert_parallel,
    expert_sizes,
    moe_layers_of,
)
from titan_parallel.float8 import Float8Training, apply_float8, precompute_float8_scales
from titan_parallel.float8_tensor_parallel import float8_tp_plan
from titan_parallel.fsdp import DataParallelOptions, apply_experts_fsdp, apply_fsdp, blocks_of
from titan_parallel.gathered_context_parallel import (
    LOAD_BALANCERS,
    gathered_context_parallel,
    ptrr_block_size,
)
from titan_parallel.grad_norm import clip_grad_norm_
from titan_parallel.load_balance import sum_tokens_per_expert
from titan_parallel.lora import (
    LoRA,
    adapter_names,
    adapters_off,
    apply_lora,
    check_targets,
    init_lora,
    initial_lora_weight,
    is_adapter_parameter,
    linear_names,
    target_linears,
)
from titan_parallel.muon import Muon, MuonTiming, muon_param_groups, newton_schulz
from titan_parallel.mx import MXTraining, apply_mx
from titan_parallel.nf4_fsdp import nf4_fsdp_torch_problem, nf4_shard_problem
from titan_parallel.options import ParallelOptions
from titan_parallel.parallel_dims import ParallelDims
from titan_parallel.parallelize import parallelize, training_context
from titan_parallel.parameter_names import plain_name
from titan_parallel.pipeline import Pipeline, build_pipeline, pipeline_stages
from titan_parallel.pipeline_options import PipelineOptions
from titan_parallel.protocols import (
    HasGatheredSequenceAttention,
    HasHiddenMatrices,
    HasInitWeights,
    HasLatentQueryKeyHeads,
    HasLinearsNotAdapted,
    HasMoELayers,
    HasPackedDocuments,
    HasParallelBlocks,
    HasPipelineUnits,
    HasQueryKeyHeads,
    HasSequenceBuffers,
    HasShardedSequenceAttention,
    HasTensorParallelPlan,
    LatentQueryKeyHeads,
    ParallelizableModel,
    TrainableModel,
)
from titan_parallel.qk_clip import clip_latent_query_key, clip_query_key
from titan_parallel.qlora import (
    NF4_BLOCK_SIZE,
    dequantized,
    is_nf4,
    nf4_size_problem,
    quantize_base_to_nf4,
    stored_bytes,
    torchao_nf4_problem,
)
from titan_parallel.sequence_shard import SequenceShard
from titan_parallel.tensor_parallel import TensorParallelOptions, apply_tp, loss_parallel_ctx
from titan_parallel.whole_copy import fill_whole

__all__ = [
    "expert_sizes",
    "ActivationCheckpointing",
    "Compile",
    "ContextParallelOptions",
    "DataParallelOptions",
    "ExpertParallel",
    "Float8Training",
    "HasHiddenMatrices",
    "HasInitWeights",
    "HasLatentQueryKeyHeads",
    "HasLinearsNotAdapted",
    "HasMoELayers",
    "HasPackedDocuments",
    "HasParallelBlocks",
    "HasPipelineUnits",
    "HasQueryKeyHeads",
    "HasSequenceBuffers",
    "HasGatheredSequenceAttention",
    "HasShardedSequenceAttention",
    "HasTensorParallelPlan",
    "LatentQueryKeyHeads",
    "LoRA",
    "MXTraining",
    "Muon",
    "MuonTiming",
    "ModelDescriptionError",
    "ParallelConfigError",
    "ParallelDims",
    "ParallelOptions",
    "ParallelizableModel",
    "Pipeline",
    "PipelineOptions",
    "SequenceShard",
    "TensorParallelExperts",
    "TensorParallelOptions",
    "TrainableModel",
    "UnsupportedDeviceError",
    "adapter_names",
    "apply_ac",
    "apply_compile",
    "apply_ddp",
    "apply_expert_parallel",
    "apply_experts_fsdp",
    "apply_float8",
    "apply_fsdp",
    "adapters_off",
    "apply_lora",
    "target_linears",
    "apply_mx",
    "apply_tp",
    "blocks_of",
    "build_pipeline",
    "check_targets",
    "clip_grad_norm_",
    "clip_latent_query_key",
    "clip_query_key",
    "context_parallel_ctx",
    "gathered_context_parallel",
    "LOAD_BALANCERS",
    "ptrr_block_size",
    "float8_tp_plan",
    "init_lora",
    "initial_lora_weight",
    "is_adapter_parameter",
    "plain_name",
    "fill_whole",
    "linear_names",
    "loss_parallel_ctx",
    "moe_layers_of",
    "muon_param_groups",
    "newton_schulz",
    "parallelize",
    "quantize_base_to_nf4",
    "stored_bytes",
    "dequantized",
    "is_nf4",
    "nf4_size_problem",
    "nf4_fsdp_torch_problem",
    "nf4_shard_problem",
    "NF4_BLOCK_SIZE",
    "torchao_nf4_problem",
    "pipeline_stages",
    "precompute_float8_scales",
    "sum_tokens_per_expert",
    "training_context",
]
