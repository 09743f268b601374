"""Llama 3.2 1B's blocks, 2 of its 16 (`llama3 1B_2layers`), for bench/muon_vs_adamw.py through
`--experimental.custom_import muon_bench_flavors`: the 1B's matrices at a size a 2-core CPU trains."""

from titan_train.registry import get_model_family, register_flavor

register_flavor("llama3", "1B_2layers", get_model_family("llama3").args_for("1B", n_layers=2))
