"""Llama model definitions, flavors and FLOP counting."""

from titan_models.args import ModelArgs
from titan_models.flavors import LLAMA3_FLAVORS, llama3_args
from titan_models.flops import count_parameters, flops_per_token
from titan_models.transformer import Transformer

__all__ = [
    "LLAMA3_FLAVORS",
    "ModelArgs",
    "Transformer",
    "count_parameters",
    "flops_per_token",
    "llama3_args",
]
