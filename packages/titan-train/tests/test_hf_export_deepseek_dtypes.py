"""A bf16 Hugging Face export of a DeepSeek-V3 model keeps what transformers reads in another precision or
from config.json: the routing bias (`e_score_correction_bias`) stays float32, as transformers declares it, and
YaRN's rope scaling is written to config.json, so transformers computes the exported weights as Titan does."""

import json
from dataclasses import replace

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from titan_ckpt import ModelState
from titan_ckpt.hf_export import write_hf_export
from titan_models.deepseek_v3 import DEEPSEEK_V3_FLAVORS, DeepSeekV3Model
from titan_train.registry import get_model_family
from titan_train.wiring.checkpointing import hf_adapter_for

BIAS = "e_score_correction_bias"


def _yarn_model() -> DeepSeekV3Model:
    """A tiny DeepSeek-V3 whose YaRN is on (yarn=True, as when a config.json names it), with random weights
    and a random routing bias large enough to change which experts the tokens reach."""
    debug = DEEPSEEK_V3_FLAVORS["debugmodel"]
    args = replace(
        debug,
        moe_args=replace(debug.moe_args, score_func="sigmoid", route_norm=True, score_before_experts=False),
        n_layers=3,
        vocab_size=256,
        max_seq_len=96,
        context_len=128,
        latent_norm_eps=1e-6,  # as DeepseekV3ForCausalLM fixes it
        final_norm_eps=debug.norm_eps,
        original_seq_len=32,
        rope_factor=4.0,
        mscale=0.707,
        yarn=True,
    )
    model = DeepSeekV3Model(args)
    model.init_weights(seed=5)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, t in model.named_buffers():
            if name.endswith("moe.expert_bias"):
                t.copy_(torch.randn(t.shape, generator=g) * 0.7 + 1e-3)  # not representable in bf16
    return model.eval()


def test_a_bf16_export_keeps_the_routing_bias_in_float32_and_the_rope_scaling(tmp_path):
    model = _yarn_model()
    adapter = hf_adapter_for(get_model_family("deepseek_v3"), model.args)
    write_hf_export(
        tmp_path,
        ModelState([model]).state_dict(),
        adapter,
        adapter.hf_config(),
        dtype=torch.bfloat16,
        max_shard_bytes=10**9,
    )

    written = {}
    for shard in tmp_path.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            written |= {k: f.get_tensor(k) for k in f.keys()}
    biases = {k: v for k, v in written.items() if k.endswith(BIAS)}
    assert biases and {v.dtype for v in biases.values()} == {torch.float32}
    assert {v.dtype for k, v in written.items() if not k.endswith(BIAS)} == {torch.bfloat16}
    ours = {k: v for k, v in model.state_dict().items() if k.endswith("moe.expert_bias")}
    assert sorted(v.tolist() for v in biases.values()) == sorted(v.tolist() for v in ours.values())

    scaling = json.loads((tmp_path / "config.json").read_text())["rope_scaling"]
    args = model.args
    assert scaling["rope_type"] == "yarn"
    assert (scaling["factor"], scaling["original_max_position_embeddings"]) == (4.0, args.original_seq_len)
    assert scaling["mscale"] == scaling["mscale_all_dim"] == 0.707

    # transformers on the export computes Titan's model with its weights rounded to bf16 (bias kept).
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if t.is_floating_point() and not name.endswith(("moe.expert_bias", "freqs_cis")):
                t.copy_(t.to(torch.bfloat16).float())
        tokens = torch.randint(0, 256, (2, 80), generator=torch.Generator().manual_seed(6))
        hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
        torch.testing.assert_close(hf(tokens).logits, model(tokens), atol=1e-5, rtol=1e-5)
