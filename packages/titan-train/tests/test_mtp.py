"""DeepSeek-V3 multi-token prediction against the paper and the published layout.

A tiny `DeepseekV3ForCausalLM` is saved by transformers and given a layer-2 MTP module as the published
checkpoint holds layer 61 (a decoder layer plus enorm, hnorm, eh_proj, shared_head and copies of the
embedding and head), every tensor random. The reference loss is the DeepSeek-V3 report's equations
(section 2.2) written here from those files: transformers' trunk for h^0 (captured before its final
norm) and a transformers `DeepseekV3DecoderLayer` holding layer 2's weights for TRM_1; the norms, the
projection, the shared head and the cross-entropies by hand. transformers itself ignores layer 2.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

from titan_models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3StateDictAdapter, args_from_hf_config
from titan_train.errors import ConfigError
from titan_train.plan import resolve
from titan_train.registry import cross_entropy_loss
from titan_train.trainer import Trainer
from titan_train.wiring.data import BUNDLED_TOKENIZER
from titan_train.wiring.mtp import MTPLoss

EPS = 1e-5
WEIGHT = 0.3  # lambda
# The MTP layer's own tensors, beside its decoder layer and its copies of the embedding and head.
_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


def _config() -> DeepseekV3Config:
    return DeepseekV3Config(
        vocab_size=2048,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        max_position_embeddings=256,
        rms_norm_eps=EPS,
    )


def _randomise(module: torch.nn.Module, seed: int) -> None:
    """Every floating parameter and buffer (the expert bias included), norms around 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if t.is_floating_point() and "inv_freq" not in name:
                scale = 0.05 if name.endswith("bias") else 0.2
                t.copy_(torch.randn(t.shape, generator=g) * scale + ("norm" in name))


def _hub_layout(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """A decoder layer's tensors under `prefix` with one matrix per expert, as `save_pretrained` writes them
    (transformers 5 fuses the experts in memory: gate_up_proj [E, 2I, D] holds gate rows then up rows)."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("experts.gate_up_proj"):
            gate, up = t.chunk(2, dim=1)
            base = prefix + name.removesuffix("gate_up_proj")
            for j in range(t.shape[0]):
                out[f"{base}{j}.gate_proj.weight"], out[f"{base}{j}.up_proj.weight"] = gate[j], up[j]
        elif name.endswith("experts.down_proj"):
            base = prefix + name.removesuffix("down_proj")
            for j in range(t.shape[0]):
                out[f"{base}{j}.down_proj.weight"] = t[j]
        else:
            out[prefix + name] = t
    return out


def _hub_checkpoint(folder: Path) -> tuple[DeepseekV3ForCausalLM, DeepseekV3DecoderLayer]:
    """The tiny checkpoint with its MTP layer 2 in the published layout; the transformers modules holding it."""
    config = _config()
    main = DeepseekV3ForCausalLM(config)
    _randomise(main, 0)
    main.save_pretrained(folder)
    layer = DeepseekV3DecoderLayer(config, layer_idx=2)  # an MoE layer, as layer 61 is
    _randomise(layer, 1)
    state = load_file(str(folder / "model.safetensors"))
    g = torch.Generator().manual_seed(2)
    dim = config.hidden_size
    mtp = _hub_layout({k: v.detach().clone() for k, v in layer.state_dict().items()}, "model.layers.2.")
    for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
        mtp[f"model.layers.2.{name}"] = 1 + 0.2 * torch.randn(dim, generator=g)
    mtp["model.layers.2.eh_proj.weight"] = 0.2 * torch.randn(dim, 2 * dim, generator=g)
    # The published layer's copies of the shared embedding and head.
    mtp["model.layers.2.embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    mtp["model.layers.2.shared_head.head.weight"] = state["lm_head.weight"].clone()
    save_file(state | mtp, str(folder / "model.safetensors"), metadata={"format": "pt"})
    hf_config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf_config, "num_nextn_predict_layers": 1}, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_TOKENIZER / name, folder / name)
    return main, layer


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def _paper_loss(main, layer, mtp: dict[str, torch.Tensor], tokens, labels) -> torch.Tensor:
    """L_main + lambda / D * L_MTP^1 (D = 1), eq. 21-25 of the DeepSeek-V3 report, over positions 1..T-1."""
    seen = {}
    hook = main.model.norm.register_forward_hook(lambda _m, args, _out: seen.update(h=args[0]))
    logits = main(tokens).logits
    hook.remove()
    batch, seq = tokens.shape
    h0 = seen["h"][:, : seq - 1]  # h_i^0, before the final norm
    embedded = main.model.embed_tokens(tokens[:, 1:])  # Emb(t_{i+1})
    # h'_i = M [RMSNorm(Emb(t_{i+1})); RMSNorm(h_i^0)]: the published weights put the embedding first.
    joined = torch.cat([_rms_norm(embedded, mtp["enorm.weight"]), _rms_norm(h0, mtp["hnorm.weight"])], -1)
    projected = joined @ mtp["eh_proj.weight"].T
    positions = torch.arange(seq - 1).expand(batch, -1)
    causal = torch.full((seq - 1, seq - 1), float("-inf")).triu(1).expand(batch, 1, -1, -1)
    out = layer(
        projected,
        attention_mask=causal,
        position_ids=positions,
        position_embeddings=main.model.rotary_emb(projected, positions),
    )
    h1 = out[0] if isinstance(out, tuple) else out
    mtp_logits = main.lm_head(_rms_norm(h1, mtp["shared_head.norm.weight"]))  # OutHead, shared
    main_loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    mtp_loss = F.cross_entropy(mtp_logits.flatten(0, 1), labels[:, 1:].flatten())  # predicts t_{i+2}
    return main_loss + WEIGHT * mtp_loss


def test_mtp_loss_and_gradients_equal_the_papers_equations_on_the_published_weights(tmp_path):
    main, layer = _hub_checkpoint(tmp_path)
    main.train()
    layer.train()
    saved = load_file(str(tmp_path / "model.safetensors"))
    mtp = {name: torch.nn.Parameter(saved[f"model.layers.2.{name}"]) for name in _OWN}
    g = torch.Generator().manual_seed(3)
    stream = torch.randint(0, 2048, (2, 33), generator=g)
    tokens, labels = stream[:, :-1], stream[:, 1:]
    expected = _paper_loss(main, layer, mtp, tokens, labels)
    expected.backward()

    config = json.loads((tmp_path / "config.json").read_text())
    args = args_from_hf_config(config, max_seq_len=64, num_mtp_layers=1)
    adapter = DeepSeekV3StateDictAdapter(args)
    model = DeepSeekV3Model(args)
    model.load_state_dict(adapter.from_hf(load_file(str(tmp_path / "model.safetensors"))))
    model.train()
    loss = MTPLoss(cross_entropy_loss, WEIGHT)(model(tokens), labels)
    loss.backward()
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)

    # Every gradient, in Titan's names: the reference's mapped by the same import (experts stacked).
    reference = _hub_layout({n: p.grad for n, p in main.named_parameters()}, "")
    reference |= _hub_layout({n: p.grad for n, p in layer.named_parameters()}, "model.layers.2.")
    reference |= {f"model.layers.2.{n}": p.grad for n, p in mtp.items()}
    buffers = [*main.named_buffers(), *(("model.layers.2." + n, b) for n, b in layer.named_buffers())]
    for name, buffer in buffers:
        if name.endswith("e_score_correction_bias"):
            reference[name] = torch.zeros_like(buffer)  # the expert bias: no gradient
    expected_grads = adapter.from_hf(reference)
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert any(n.startswith("mtp.") for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], atol=1e-6, rtol=1e-4, msg=name)


def _flags(folder: Path, *extra: str) -> tuple[str, ...]:
    return (
        "--model.name",
        "deepseek_v3",
        "--model.flavor",
        "from_hf",
        "--model.hf_assets_path",
        str(folder),
        "--checkpoint.enable",
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.initial_load_path",
        str(folder),
        *extra,
    )


def test_continued_pretraining_exports_the_mtp_layer_bit_for_bit(tmp_path, small_config, one_rank):
    folder = tmp_path / "hub"
    folder.mkdir()
    _hub_checkpoint(folder)
    dump = tmp_path / "run"
    config = small_config(
        dump,
        *_flags(folder, "--model.num_mtp_layers", "1", "--model.moe_load_balance_coeff", "0"),
        "--training.steps",
        "1",
        "--optimizer.lr",
        "0",  # trains nothing: the export must be the import
        "--checkpoint.last_save_in_hf",
    )
    Trainer(resolve(config, 1, "cpu"), one_rank).train()
    record = json.loads((dump / "metrics.jsonl").read_text().splitlines()[0])
    assert record["mtp_loss"] > 0

    exported_files = [p for p in dump.rglob("*.safetensors")]
    assert exported_files
    exported = {}
    for file in exported_files:
        exported |= load_file(str(file))
    source = load_file(str(folder / "model.safetensors"))
    assert sorted(exported) == sorted(source)
    assert any(k.startswith("model.layers.2.") for k in source)
    for name, tensor in source.items():
        out = exported[name]
        assert out.dtype == tensor.dtype and out.shape == tensor.shape, name
        assert torch.equal(out.view(torch.uint8), tensor.view(torch.uint8)), name
    hf_configs = [json.loads(p.read_text()) for p in dump.rglob("config.json") if p.parent != dump]
    assert [c.get("num_nextn_predict_layers") for c in hf_configs] == [1]


def test_a_checkpoint_without_the_mtp_layer_is_refused_in_one_line(tmp_path, small_config, one_rank):
    folder = tmp_path / "hub"
    folder.mkdir()
    _hub_checkpoint(folder)
    state = load_file(str(folder / "model.safetensors"))
    save_file(
        {k: v for k, v in state.items() if not k.startswith("model.layers.2.")},
        str(folder / "model.safetensors"),
    )
    config = small_config(
        tmp_path / "run", *_flags(folder, "--model.num_mtp_layers", "1"), "--training.steps", "1"
    )
    with pytest.raises(Exception, match="no multi-token-prediction layer 2") as err:
        Trainer(resolve(config, 1, "cpu"), one_rank).train()
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "flags, refusal, world",
    [
        (("--model.num_mtp_layers", "1"), "llama3 has no multi-token-prediction layers", 2),
        (("--model.mtp_loss_weight", "0.3"), "model.num_mtp_layers is 0", 2),
        (
            (
                "--model.name",
                "deepseek_v3",
                "--model.num_mtp_layers",
                "1",
                "--parallelism.context_parallel_degree",
                "2",
            ),
            "parallelism.context_parallel_degree > 1",
            2,
        ),
        (
            (
                "--model.name",
                "deepseek_v3",
                "--model.num_mtp_layers",
                "1",
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.tensor_parallel_degree",
                "2",
            ),
            "pipeline and tensor parallelism together",
            4,
        ),
    ],
)
def test_what_mtp_cannot_run_with_is_refused_at_start(tmp_path, small_config, flags, refusal, world):
    with pytest.raises(ConfigError, match=refusal) as err:
        resolve(small_config(tmp_path, *flags), world, "cpu")
    assert "\n" not in str(err.value)
