"""QLoRA on a CPU: LoRA over an NF4 base against LoRA over a bfloat16 base, same weights, same data.

The llama3 debug model shape cut to `--layers` blocks (default 2; dim 256, vocab 2048: a few minutes on a
CPU, where NF4's dequantise-per-matmul costs the most) is initialised once (seed 0) and cast to bfloat16;
LoRA (all-linear, rank 8, alpha 16) is attached with the same initial adapters in both runs; the QLoRA run
then stores every adapted layer's frozen weight in torchao's NF4 (`titan_parallel.quantize_base_to_nf4`).
Both train the adapters with AdamW (lr 3e-3) for `--steps` steps on the same batches of the bundled c4_test
text (bundled tokenizer). The table shows the bytes the adapted layers' frozen weights occupy per parameter,
the adapters' bytes, and the losses.

    uv run python bench/qlora_nf4.py [--steps 20 --layers 2]
"""

from __future__ import annotations

import argparse
import os
import time

# bfloat16 matmuls can die with SIGILL on VMs whose oneDNN picks AMX kernels they cannot run.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_FP16")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from titan_models import Transformer, llama3_args  # noqa: E402
from titan_parallel import LoRA, adapter_names, apply_lora, init_lora, quantize_base_to_nf4, stored_bytes  # noqa: E402


def _batches(steps: int, batch: int, seq: int) -> list[torch.Tensor]:
    """`steps` batches of `batch` x (`seq` + 1) tokens of the bundled c4_test text (bundled tokenizer)."""
    import json
    from pathlib import Path

    import titan_data
    from titan_data import build_tokenizer

    assets = Path(titan_data.__file__).parent / "assets"
    tokenizer = build_tokenizer(assets / "tokenizer")
    ids: list[int] = []
    need = steps * batch * (seq + 1)
    for line in (assets / "c4_test" / "c4_test.jsonl").read_text().splitlines():
        ids.extend(tokenizer.encode(json.loads(line)["text"], bos=True, eos=True))
        if len(ids) >= need:
            break
    return list(torch.tensor(ids[:need]).view(steps, batch, seq + 1))


def _model(quantize: bool, layers: int) -> tuple[torch.nn.Module, int]:
    torch.manual_seed(0)
    args = llama3_args("debugmodel")
    args.n_layers = layers
    model = Transformer(args)
    model.init_weights(seed=0)
    for param in model.parameters():  # the rotary table (a complex buffer) stays as it is
        param.data = param.data.to(torch.bfloat16)
    apply_lora(model, LoRA(rank=8, alpha=16.0, targets=("all-linear",)))
    init_lora(model, seed=0)
    if quantize:
        quantize_base_to_nf4(model, scaler_block_size=256)
    modules = dict(model.named_modules())
    base_params = sum(modules[n].weight.numel() for n in adapter_names(model))
    return model, base_params


def run(quantize: bool, batches: list[torch.Tensor], layers: int) -> dict:
    model, base_params = _model(quantize, layers)
    modules = dict(model.named_modules())
    base_bytes = sum(stored_bytes(modules[n].weight) for n in adapter_names(model))
    adapters = [p for p in model.parameters() if p.requires_grad]
    adapter_bytes = sum(p.numel() * p.element_size() for p in adapters)
    optimizer = torch.optim.AdamW(adapters, lr=3e-3)
    losses = []
    model.train()
    start = time.perf_counter()
    for tokens in batches:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {
        "base_params": base_params,
        "bytes_per_param": base_bytes / base_params,
        "adapter_bytes": adapter_bytes,
        "losses": losses,
        "seconds_per_step": (time.perf_counter() - start) / len(batches),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    a = parser.parse_args()
    batches = _batches(a.steps, a.batch, a.seq)
    rows = {
        name: run(q, batches, a.layers)
        for name, q in (("LoRA, bfloat16 base", False), ("QLoRA, NF4 base", True))
    }
    print(
        f"llama3 debugmodel shape with {a.layers} layers, all-linear rank 8, {a.steps} steps of {a.batch} x {a.seq} c4_test tokens, CPU"
    )
    print("| run | adapted base params | base bytes/param | adapter bytes | loss step 1 | loss step 10 | "
          f"loss step {a.steps} | mean loss last 5 | s/step |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        losses = r["losses"]
        print(
            f"| {name} | {r['base_params']:,} | {r['bytes_per_param']:.4f} | {r['adapter_bytes']:,} | {losses[0]:.4f} | "
            f"{losses[min(9, len(losses) - 1)]:.4f} | {losses[-1]:.4f} | {sum(losses[-5:]) / len(losses[-5:]):.4f} | {r['seconds_per_step']:.2f} |"
        )


if __name__ == "__main__":
    main()
