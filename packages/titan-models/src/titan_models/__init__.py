"""Llama 2/3 model definitions, flavors, attention backends, FLOP counting, HF weight mapping and generation."""

from titan_models.args import ATTENTION_BACKENDS, MASK_TYPES, ModelArgs, RopeScaling
from titan_models.attention_masks import document_ids, documents_from_positions
from titan_models.errors import BackendUnavailableError, ModelConfigError, ModelError, WeightMappingError
from titan_models.flavors import LLAMA2_FLAVORS, LLAMA3_FLAVORS, llama2_args, llama3_args
from titan_models.flops import count_parameters, flops_per_token
from titan_models.generation import Generation, SamplingParams, generate, sample_next
from titan_models.hf_adapter import LlamaStateDictAdapter
from titan_models.hf_config import args_from_hf_config, hf_config_differences, to_hf_config
from titan_models.kv_cache import KVCache, forward_cached
from titan_models.safetensors_io import load_safetensors_sharded, save_safetensors_sharded
from titan_models.transformer import Transformer

__all__ = [
    "ATTENTION_BACKENDS",
    "LLAMA2_FLAVORS",
    "LLAMA3_FLAVORS",
    "MASK_TYPES",
    "BackendUnavailableError",
    "Generation",
    "KVCache",
    "LlamaStateDictAdapter",
    "ModelArgs",
    "ModelConfigError",
    "ModelError",
    "RopeScaling",
    "SamplingParams",
    "Transformer",
    "WeightMappingError",
    "args_from_hf_config",
    "count_parameters",
    "document_ids",
    "documents_from_positions",
    "flops_per_token",
    "forward_cached",
    "generate",
    "hf_config_differences",
    "llama2_args",
    "llama3_args",
    "load_safetensors_sharded",
    "sample_next",
    "save_safetensors_sharded",
    "to_hf_config",
]
