"""Rollout tokens/s of GRPO's two engines on one model and one prompt batch: Titan's KV-cache generator in this
process (`grpo.engine = "titan"`) against a vLLM server in apps/vllm's environment (`grpo.engine = "vllm"`,
apps/vllm/serve.py, started as the engine starts it, float32, eager).

The model is Llama 3's `debugmodel` shape with 8 heads of 32 (vLLM's CPU attention has no kernel for the flavor's
16), random weights from `init_weights(seed=0)`, exported the Titan way. Each engine samples `--groups` random
prompts of `--prompt-len` ids x `--generations` completions of exactly `--new` tokens at temperature 1 (no stop
ids), `--repeats` times after one warm-up, Titan's before the server starts (an idle vLLM engine spins on the
cores: Titan measured 47 tokens/s beside it); tokens/s counts the generated tokens over the wall clock of the call
(vLLM's: the HTTP request, its start-up reported apart). Prints a table with the ratio.

    uv run python bench/rollout_engines.py [--groups 4] [--generations 8] [--prompt-len 32] [--new 32] [--threads 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from titan_ckpt import ModelState
from titan_ckpt.hf_export import write_hf_export
from titan_models.generation import SamplingParams, generate
from titan_train.objectives.vllm_engine import call, start_server, stop_server
from titan_train.registry import get_model_family
from titan_train.wiring.checkpointing import hf_adapter_for

REPO = Path(__file__).resolve().parents[1]


def _model():
    family = get_model_family("llama3")
    args = family.args_for("debugmodel", n_heads=8)
    model = family.build(args)
    model.init_weights(seed=0)
    return family, args, model.eval()


def _titan(model, prompts: list[list[int]], g: int, new: int, seed: int) -> float:
    params = SamplingParams(max_new_tokens=new, temperature=1.0, seed=seed)
    started = time.perf_counter()
    with torch.no_grad():
        out = generate(model, [p for p in prompts for _ in range(g)], params)
    seconds = time.perf_counter() - started
    assert all(len(t) == new for t in out.tokens)
    return len(prompts) * g * new / seconds


def _vllm(url: str, prompts: list[list[int]], g: int, new: int, seed: int) -> float:
    body = {"prompts": prompts, "n": g, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_tokens": new}
    started = time.perf_counter()
    reply = call(url, "/generate", {**body, "stop_token_ids": [], "seed": seed})
    seconds = time.perf_counter() - started
    assert all(len(t) == new for t in reply["ids"])
    return len(prompts) * g * new / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    a = parser.parse_args()
    torch.set_num_threads(a.threads)
    family, args, model = _model()
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, args.vocab_size, (a.groups, a.prompt_len), generator=gen).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "export"
        adapter = hf_adapter_for(family, args, bos_id=1, eos_id=2)
        config = {**adapter.hf_config(), "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}
        write_hf_export(
            folder,
            ModelState([model]).state_dict(),
            adapter,
            config,
            dtype=torch.float32,
            max_shard_bytes=10**9,
        )
        rates = {"titan": [], "vllm": []}
        # Titan's calls first, with no server up: vLLM's idle engine keeps its threads spinning on the cores.
        for k in range(a.repeats + 1):  # the first call of each engine is a warm-up
            rates["titan"].append(_titan(model, prompts, a.generations, a.new, k))
        started = time.perf_counter()
        server, url = start_server(
            REPO / "apps" / "vllm",
            folder,
            max_model_len=a.prompt_len + a.new,
            gpu_memory_utilization=0.15,
            seed=0,
            dtype="float32",
            log=Path(tmp) / "server.log",
        )
        start_s = time.perf_counter() - started
        try:
            for k in range(a.repeats + 1):
                rates["vllm"].append(_vllm(url, prompts, a.generations, a.new, k))
        finally:
            stop_server(server)
    tokens = a.groups * a.generations * a.new
    print(
        f"llama3 debugmodel (8 heads of 32), float32, {a.threads} threads: {a.groups} prompts of {a.prompt_len} ids "
        f"x {a.generations} completions of {a.new} tokens = {tokens} tokens a call; vLLM start-up {start_s:.0f} s"
    )
    print(f"| engine | tokens/s (mean of calls 2-{a.repeats + 1}) | each call |")
    print("|---|---|---|")
    mean = {k: sum(v[1:]) / len(v[1:]) for k, v in rates.items()}
    for k, v in rates.items():
        print(f"| {k} | {mean[k]:,.0f} | {', '.join(f'{x:,.0f}' for x in v[1:])} |")
    print(f"vllm / titan: {mean['vllm'] / mean['titan']:.2f}")


if __name__ == "__main__":
    main()
