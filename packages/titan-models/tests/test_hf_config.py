"""Reading and writing Hugging Face `config.json`, and naming every field in which one differs from a flavor."""

import json
from dataclasses import replace

import pytest
from transformers import LlamaConfig

from titan_models import (
    ModelConfigError,
    args_from_hf_config,
    hf_config_differences,
    llama3_args,
    to_hf_config,
)


def _as_transformers_writes_it(config: dict, tmp_path) -> dict:
    """The config.json transformers itself saves for `config` (transformers 5: `rope_parameters`)."""
    LlamaConfig(**config).save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


@pytest.mark.parametrize("flavor", ["debugmodel", "1B", "8B"])
def test_a_flavor_written_and_read_back_through_transformers_has_no_differences(flavor, tmp_path):
    args = llama3_args(flavor)
    saved = _as_transformers_writes_it(to_hf_config(args, bos_id=1, eos_id=2, dtype="bfloat16"), tmp_path)
    assert hf_config_differences(args, saved) == []
    back = args_from_hf_config(saved)
    assert (back.ffn_hidden_dim, back.context_len, back.rope_scaling) == (
        args.ffn_hidden_dim,
        131_072,
        args.rope_scaling,
    )


def test_every_field_that_changes_the_function_is_named():
    args = llama3_args("debugmodel")
    config = to_hf_config(
        replace(
            args,
            rope_scaling=replace(args.rope_scaling, factor=32.0, high_freq_factor=2.0),
            rope_theta=10000,
            norm_eps=1e-6,
            tie_word_embeddings=True,
            n_kv_heads=4,
        )
    )
    assert hf_config_differences(args, config) == [
        "num_key_value_heads: checkpoint 4, flavor 16",
        "rms_norm_eps: checkpoint 1e-06, flavor 1e-05",
        "rope_theta: checkpoint 10000.0, flavor 500000.0",
        "tie_word_embeddings: checkpoint True, flavor False",
        "rope_scaling.factor: checkpoint 32.0, flavor 8.0",
        "rope_scaling.high_freq_factor: checkpoint 2.0, flavor 4.0",
    ]
    unscaled = dict(to_hf_config(args), rope_scaling=None)
    assert hf_config_differences(args, unscaled) == ["rope_scaling: checkpoint None, flavor llama3"]


def test_settings_titan_cannot_compute_are_refused():
    config = dict(to_hf_config(llama3_args("debugmodel")), attention_bias=True)
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    assert hf_config_differences(llama3_args("debugmodel"), config) == [
        "attention_bias true (Titan's Llama has no biases)",
        "rope_scaling.rope_type 'yarn' (Titan implements 'llama3' only)",
    ]
    with pytest.raises(ModelConfigError, match="cannot be trained by Titan: attention_bias true"):
        args_from_hf_config(config)
