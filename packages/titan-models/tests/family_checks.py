"""What every model family's tests do alike: build a model as the trainer does, and check it against
Hugging Face's implementation both ways (a transformers checkpoint imported gives equal logits and maps
back to the same tensors; Titan's export loads in transformers with equal logits)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from titan_models import ModelConfigError, load_safetensors_sharded, save_safetensors_sharded


def materialised(cls, args, seed: int = 0) -> torch.nn.Module:
    """`cls(args)` built on the meta device, moved to the CPU and initialised from `seed`."""
    with torch.device("meta"):
        model = cls(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


def perturb(model: torch.nn.Module, seed: int) -> None:
    """Random weights, norms away from 1 so that a swapped or missing norm would show."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn(p.shape, generator=gen))


# The rotary table is no state: it is computed from the config, as transformers rebuilds it from config.json
# (whose round trip the import checks test). Every other buffer is randomised, the token counts included
# (an eval forward must not read them).
_DERIVED_BUFFERS = ("freqs_cis",)


def perturb_buffers(model: torch.nn.Module, adapter: Any, seed: int) -> list[str]:
    """Random values in every floating buffer of `model` an export must carry (the expert bias, where
    the Hugging Face class holds one): all but the derived ones and those the adapter declares it cannot
    hold (`hf_unheld_state`: Llama 4's and Qwen3-MoE's expert bias, whose refusal and warning
    packages/titan-train/tests/test_hf_export_unheld_state.py covers). A buffer the export drops without
    declaring it then changes the logits. Returns the perturbed buffers' names."""
    unheld = getattr(adapter, "hf_unheld_state", ())
    gen = torch.Generator().manual_seed(seed)
    perturbed = []
    with torch.no_grad():
        for name, b in model.named_buffers():
            if b.is_floating_point() and not name.endswith((*_DERIVED_BUFFERS, *unheld)):
                b.copy_(0.5 * torch.randn(b.shape, generator=gen))
                perturbed.append(name)
    return perturbed


def tokens_for(args) -> torch.Tensor:
    """A fixed batch of 2 sequences of `max_seq_len` token ids."""
    return torch.randint(
        0, args.vocab_size, (2, args.max_seq_len), generator=torch.Generator().manual_seed(0)
    )


def check_hf_import(
    args: Any,
    adapter: Any,
    model_cls: type,
    tmp_path: Path,
    *,
    args_from_hf_config: Callable[..., Any],
    hf_config_differences: Callable[..., list[str]],
    attn_implementation: str,
    seed: int,
) -> dict[str, torch.Tensor]:
    """A random transformers model of `adapter.hf_config()`, saved and imported: its config agrees with
    `args`, Titan's logits equal transformers' to 1e-5, and mapping back gives the same tensors.
    Returns the saved Hugging Face state dict."""
    hf_config = AutoConfig.for_model(**adapter.hf_config())
    hf_config._attn_implementation = attn_implementation
    hf = AutoModelForCausalLM.from_config(hf_config).eval()
    perturb(hf, seed=seed)
    hf.save_pretrained(tmp_path)
    hf_state = load_safetensors_sharded(tmp_path)

    config = json.loads((tmp_path / "config.json").read_text())
    assert hf_config_differences(args, config) == []
    ours = model_cls(args_from_hf_config(config, max_seq_len=args.max_seq_len)).eval()
    ours.load_state_dict(adapter.from_hf(hf_state), strict=True)
    with torch.no_grad():
        expected, got = hf(tokens_for(args)).logits, ours(tokens_for(args))
    assert (got - expected).abs().max().item() <= 1e-5
    assert expected.abs().max().item() > 0.5  # not a comparison of near-zero logits

    back = adapter.to_hf(ours.state_dict())
    assert back.keys() == hf_state.keys()
    assert all(torch.equal(back[k], hf_state[k]) for k in hf_state)
    return hf_state


def check_hf_export(
    args: Any, adapter: Any, model_cls: type, tmp_path: Path, *, attn_implementation: str, hf_class: str
) -> None:
    """Titan's export of an initialised model with random parameters and buffers (`perturb_buffers`)
    loads with `AutoModelForCausalLM` as `hf_class` and gives logits equal to Titan's to 1e-5."""
    ours = materialised(model_cls, args, seed=5)
    perturb(ours, seed=6)
    perturb_buffers(ours, adapter, seed=7)
    ours.eval()
    save_safetensors_sharded(adapter.to_hf(ours.state_dict()), tmp_path, config=adapter.hf_config())
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=attn_implementation).eval()
    assert type(hf).__name__ == hf_class
    with torch.no_grad():
        assert (hf(tokens_for(args)).logits - ours(tokens_for(args))).abs().max().item() <= 1e-5


def check_refused_in_one_line(
    args_from_hf_config: Callable[..., Any], config: dict[str, Any], field: str
) -> None:
    """Reading `config` fails with one `ModelConfigError` line that names `field`."""
    with pytest.raises(ModelConfigError, match=field) as caught:
        args_from_hf_config(config)
    assert "\n" not in str(caught.value)
