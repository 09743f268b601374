"""Llama 3.1 8B's block shape with only a few blocks: what one GPU can hold of an 8B-shaped model.

bench/memory_vs_gpu.py imports this through `--experimental.custom_import cut_flavors`, in the dry
run and in the training run alike, so both see the same `8B_4layers` flavor.
"""

from __future__ import annotations

from dataclasses import replace

from titan_models import LLAMA3_FLAVORS

LLAMA3_FLAVORS["8B_4layers"] = replace(LLAMA3_FLAVORS["8B"], n_layers=4)
