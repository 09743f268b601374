"""An `experimental.custom_import` module: registers `llama3 tiny` (2 layers, dim 64, 4 heads), small enough
that a replica-group drill of many steps stays cheap on a shared 2-core machine."""

from titan_train.registry import get_model_family, register_flavor

register_flavor(
    "llama3", "tiny", get_model_family("llama3").args_for("debugmodel", n_layers=2, dim=64, n_heads=4)
)
