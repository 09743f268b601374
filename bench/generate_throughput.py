"""Generation tokens/s: Titan's KV-cache `generate` against transformers' `generate`, on the same weights;
with `--moe`, the KV cache against recomputing the whole sequence each step for each MoE family.

Llama (default): builds a Titan Llama (a flavor's shape, random weights from `init_weights`), maps them into
transformers' `LlamaForCausalLM`, and generates greedily from the same prompts with both, in one
process, alternating runs so that load on the machine hits both alike. Prints one row per batch size:
new tokens per second over the whole call (prefill included), best of `--repeats`, and checks that
the two produce the same tokens.

    uv run python bench/generate_throughput.py [--flavor debugmodel] [--batch 1,8] [--new 128] [--threads 2]

`--moe`: each MoE family's debug flavor (Qwen3-MoE, Llama 4, DeepSeek-V3, gpt-oss; random weights from
`init_weights`) generates from the same prompts through the KV cache (one left-padded batch) and through
`generate(..., kv_cache=False)` (the model's own forward over the whole sequence at every step, one
prompt at a time), alternating in one process; one row per family with both tokens/s and their ratio.

    uv run python bench/generate_throughput.py --moe [--batch 4] [--prompt 32] [--new 32] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from titan_models import (
    LlamaStateDictAdapter,
    SamplingParams,
    Transformer,
    generate,
    llama3_args,
    to_hf_config,
)
from titan_models.decoder import Decoder
from titan_models.deepseek_v3 import DeepSeekV3Model, deepseek_v3_args
from titan_models.gpt_oss import GptOssModel, gpt_oss_args
from titan_models.llama4 import Llama4Model, llama4_args
from titan_models.qwen3 import Qwen3Model, qwen3_args

MOE_FLAVORS = {
    "qwen3 debugmodel_moe": (Qwen3Model, lambda: qwen3_args("debugmodel_moe")),
    "llama4 debugmodel": (Llama4Model, lambda: llama4_args("debugmodel")),
    "deepseek_v3 debugmodel": (DeepSeekV3Model, lambda: deepseek_v3_args("debugmodel")),
    "gpt_oss debugmodel": (GptOssModel, lambda: gpt_oss_args("debugmodel")),
}


def build(flavor: str, layers: int | None, max_seq_len: int) -> tuple[Transformer, LlamaForCausalLM]:
    args = llama3_args(flavor)
    args.max_seq_len = max_seq_len
    if layers:
        args.n_layers = layers
    with torch.device("meta"):
        ours = Transformer(args)
    ours.to_empty(device="cpu")
    ours.init_weights(seed=0)
    ours.eval()
    config = {**to_hf_config(args), "bos_token_id": None, "eos_token_id": None}  # every token generated
    hf = LlamaForCausalLM(LlamaConfig(**config)).eval()
    hf.load_state_dict(
        LlamaStateDictAdapter(args).to_hf(ours.state_dict()), strict=not args.tie_word_embeddings
    )
    if args.tie_word_embeddings:
        hf.tie_weights()
    return ours, hf


def prompts_for(batch: int, vocab: int, length: int) -> list[list[int]]:
    """Prompts of different lengths (length/2 to length), as a served batch has."""
    gen = torch.Generator().manual_seed(batch)
    return [
        torch.randint(0, vocab, (length - (i * length // 2) // max(batch - 1, 1),), generator=gen).tolist()
        for i in range(batch)
    ]


def titan_run(model: Transformer, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    out = generate(model, prompts, SamplingParams(max_new_tokens=new))
    return time.perf_counter() - start, out.tokens


def hf_run(model: LlamaForCausalLM, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
    return time.perf_counter() - start, out[:, width:].tolist()


def build_moe(name: str, max_seq_len: int) -> Decoder:
    cls, make_args = MOE_FLAVORS[name]
    args = make_args()
    args.max_seq_len = max_seq_len
    with torch.device("meta"):
        model = cls(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model.eval()


def timed(
    model: Decoder, prompts: list[list[int]], new: int, kv_cache: bool
) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    out = generate(model, prompts, SamplingParams(max_new_tokens=new), kv_cache=kv_cache)
    return time.perf_counter() - start, out.tokens


def moe_table(args: argparse.Namespace) -> None:
    batch = int(args.batch.split(",")[0])
    print(
        f"MoE debug flavors, float32, {args.threads} threads, batch {batch}, prompts up to {args.prompt} "
        f"tokens, {args.new} new tokens, greedy, best of {args.repeats}"
    )
    print("| model | KV cache tokens/s | recompute tokens/s | cache / recompute | same tokens |")
    print("|:------|------------------:|-------------------:|------------------:|:-----------:|")
    for name in MOE_FLAVORS:
        model = build_moe(name, args.prompt + args.new)
        prompts = prompts_for(batch, model.args.vocab_size, args.prompt)
        timed(model, prompts, 2, True), timed(model, prompts, 2, False)  # warm-up
        cached_s, recomputed_s = [], []
        for _ in range(args.repeats):
            seconds, cached = timed(model, prompts, args.new, True)
            cached_s.append(seconds)
            seconds, recomputed = timed(model, prompts, args.new, False)
            recomputed_s.append(seconds)
        new_tokens = batch * args.new
        cached_tps, recomputed_tps = new_tokens / min(cached_s), new_tokens / min(recomputed_s)
        print(
            f"| {name} | {cached_tps:17,.0f} | {recomputed_tps:18,.0f} | {cached_tps / recomputed_tps:16.2f}x | "
            f"{'yes' if cached == recomputed else 'NO':^11} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--layers", type=int, help="cut the flavor to this many blocks")
    parser.add_argument("--batch", default="1,8", help="batch sizes, comma-separated")
    parser.add_argument("--prompt", type=int, default=32, help="longest prompt, tokens")
    parser.add_argument("--new", type=int, default=128, help="new tokens per prompt")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--moe", action="store_true", help="KV cache against recomputing, per MoE family")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.moe:
        moe_table(args)
        return
    ours, hf = build(args.flavor, args.layers, args.prompt + args.new)
    print(
        f"{args.flavor} ({ours.args.n_layers} layers, dim {ours.args.dim}), float32, {args.threads} threads, "
        f"prompts up to {args.prompt} tokens, {args.new} new tokens, greedy, best of {args.repeats}"
    )
    print("| batch | Titan tokens/s | transformers tokens/s | Titan / transformers | same tokens |")
    print("|------:|---------------:|----------------------:|---------------------:|:-----------:|")
    for batch in (int(b) for b in args.batch.split(",")):
        prompts = prompts_for(batch, ours.args.vocab_size, args.prompt)
        titan_run(ours, prompts, 4), hf_run(hf, prompts, 4)  # warm-up: first-call allocations
        titan_s, hf_s = [], []
        for _ in range(args.repeats):
            seconds, titan_tokens = titan_run(ours, prompts, args.new)
            titan_s.append(seconds)
            seconds, hf_tokens = hf_run(hf, prompts, args.new)
            hf_s.append(seconds)
        new_tokens = batch * args.new
        titan_tps, hf_tps = new_tokens / min(titan_s), new_tokens / min(hf_s)
        print(
            f"| {batch:5} | {titan_tps:14,.0f} | {hf_tps:21,.0f} | {titan_tps / hf_tps:19.2f}x | "
            f"{'yes' if titan_tokens == hf_tokens else 'NO':^11} |"
        )


if __name__ == "__main__":
    main()
