"""torchtitan 0.3.0 trainer configs for bench/train_throughput.py, loaded only by torchtitan in its own
environment (`--module torchtitan_bench_configs --config llama3_bench_1B`); Titan never imports this.

torchtitan's registry has trainer configs for debugmodel, 8B, 70B and 405B only, although its model
registry also holds the Llama 3.2 1B and 3B shapes. Each config here is torchtitan's own debugmodel
trainer config (the c4_test data and the test tokenizer) with the model swapped for the flavor and
activation checkpointing off, as in Titan's `apps/configs/debug_model.toml`. Validation, checkpoints
and profiling are off in both, so both runs time the same training steps. Attention stays torchtitan's
default, causal flex attention: 0.3.0 refuses SDPA for language models ("sdpa is no longer supported").
"""

from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.llama3 import llama3_configs, model_registry
from torchtitan.models.llama3.config_registry import llama3_debugmodel


def _bench_config(flavor: str):
    config = llama3_debugmodel()
    config.model_spec = model_registry(flavor)
    config.loss = ChunkedLossWrapper.Config(
        loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(config.model_spec))
    )
    config.activation_checkpoint = None
    config.validator.enable = False
    return config


for _flavor in llama3_configs:
    globals()[f"llama3_bench_{_flavor}"] = lambda flavor=_flavor: _bench_config(flavor)
