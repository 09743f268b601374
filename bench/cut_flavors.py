"""Llama 3.1 8B's block shape with only a few blocks: what one GPU can hold of an 8B-shaped model.

bench/memory_vs_gpu.py imports this through `--experimental.custom_import cut_flavors`, in the dry
run and in the training run alike, so both see the same `8B_4layers` flavor.
"""

from __future__ import annotations

from titan_train.registry import get_model_family, register_flavor

register_flavor("llama3", "8B_4layers", get_model_family("llama3").args_for("8B", n_layers=4))
