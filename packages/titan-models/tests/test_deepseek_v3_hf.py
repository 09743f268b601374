"""DeepSeek-V3 both ways with Hugging Face: a tiny `DeepseekV3ForCausalLM` saved by transformers computes the
same logits in Titan, and Titan's export loads in transformers with the same logits (fp32)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from titan_models import ModelConfigError
from titan_models.deepseek_v3 import (
    DEEPSEEK_V3_FLAVORS,
    DeepSeekV3Model,
    DeepSeekV3StateDictAdapter,
    args_from_hf_config,
    hf_config_differences,
    to_hf_config,
)

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}


def _hf_config(q_lora_rank, yarn: bool):
    return transformers.DeepseekV3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=1.5,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_parameters=_YARN if yarn else {"rope_type": "default", "rope_theta": 10000.0},
    )


def _randomise(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if t.is_floating_point() and not name.endswith(("inv_freq", "original_inv_freq", "freqs_cis")):
                t.copy_(
                    torch.randn(t.shape, generator=g) * (0.3 if "bias" not in name else 0.05)
                    + ("norm" in name)
                )


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("q_lora_rank, yarn", [(None, False), (24, True)])
def test_transformers_checkpoint_gives_the_same_logits_in_titan(tmp_path, q_lora_rank, yarn):
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(_hf_config(q_lora_rank, yarn)).eval()
    _randomise(hf, 0)
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    args = args_from_hf_config(config, max_seq_len=64)
    assert args.uses_yarn == yarn
    state = safetensors_torch.load_file(tmp_path / "model.safetensors")
    model = DeepSeekV3Model(args)
    model.load_state_dict(DeepSeekV3StateDictAdapter(args).from_hf(state))
    tokens = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(model(tokens), _hf_logits(hf, tokens), atol=1e-5, rtol=1e-5)
    assert hf_config_differences(args, config) == []


def test_titan_export_loads_in_transformers_with_the_same_logits(tmp_path):
    args = replace(args_from_hf_config(_hf_config(24, yarn=True).to_dict(), max_seq_len=64), vocab_size=128)
    model = DeepSeekV3Model(args)
    model.init_weights(seed=3)
    _randomise(model, 3)  # larger weights than the init, and a non-zero expert bias
    adapter = DeepSeekV3StateDictAdapter(args)
    safetensors_torch.save_file(
        {k: v.contiguous() for k, v in adapter.to_hf(model.state_dict()).items()},
        tmp_path / "model.safetensors",
    )
    (tmp_path / "config.json").write_text(json.dumps(adapter.hf_config()))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokens = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(_hf_logits(hf, tokens), model(tokens), atol=1e-5, rtol=1e-5)
    # And back: the exported tensors are the model's own.
    back = adapter.from_hf(adapter.to_hf(model.state_dict()))
    for name, t in model.state_dict().items():
        torch.testing.assert_close(back[name], t)


def test_config_round_trip_and_field_by_field_differences():
    args = replace(DEEPSEEK_V3_FLAVORS["671B"], latent_norm_eps=1e-6, max_seq_len=8192)
    config = to_hf_config(args)
    back = args_from_hf_config(config, max_seq_len=8192)
    assert hf_config_differences(back, config) == []
    assert hf_config_differences(args, config) == []
    other = {**config, "routed_scaling_factor": 1.0, "n_shared_experts": 2}
    diffs = hf_config_differences(args, other)
    assert [d.split(":")[0] for d in diffs] == ["n_shared_experts", "routed_scaling_factor"]


@pytest.mark.parametrize(
    "change, field",
    [
        ({"rope_interleave": False}, "rope_interleave"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {**_YARN, "mscale": 1.0}}, "rope_scaling.mscale"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling.rope_type"),
        # Kimi K2.5's multimodal folder, and a Kimi-named class Titan does not read weights for.
        ({"model_type": "kimi_k25"}, "model_type 'kimi_k25'"),
        ({"model_type": "kimi_k2", "architectures": ["KimiK2ForCausalLM"]}, "architectures"),
    ],
)
def test_configs_titan_cannot_compute_are_refused_naming_the_field(change, field):
    config = {**to_hf_config(replace(DEEPSEEK_V3_FLAVORS["671B"], latent_norm_eps=1e-6)), **change}
    with pytest.raises(ModelConfigError, match=field) as err:
        args_from_hf_config(config)
    assert "\n" not in str(err.value)


def test_a_kimi_k2_config_reads_as_deepseek_v3s():
    """Kimi K2's folders name model_type kimi_k2 (architectures DeepseekV3ForCausalLM, auto_map to custom
    code): the same args as the config under DeepSeek-V3's own name."""
    config = to_hf_config(replace(DEEPSEEK_V3_FLAVORS["kimi_k2"], eos_id=0))
    kimi = {
        **config,
        "model_type": "kimi_k2",
        "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"},
    }
    assert args_from_hf_config(kimi) == args_from_hf_config(config)
    assert hf_config_differences(args_from_hf_config(config), kimi) == []


def test_export_refuses_routing_transformers_cannot_compute():
    with pytest.raises(ModelConfigError, match="moe.score_func"):
        to_hf_config(DEEPSEEK_V3_FLAVORS["16B"])  # DeepSeek-V2(-Lite) routes with softmax
