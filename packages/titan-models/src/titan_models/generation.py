"""Text generation from token ids: prefill, then one token a step from the KV cache.

Greedy decoding (temperature 0) or sampling with temperature, top-k and top-p from a seeded
generator, or one generator per row (`row_seeds`: a row then draws the same tokens in any batch). A row stops at an end-of-sequence id, at a stop string (needs `decode`, since titan-models
holds no tokenizer), or after `max_new_tokens`; the others go on. Prompts of different lengths run
as one left-padded batch.

Every family (Llama, Qwen3, Llama 4, DeepSeek-V3, gpt-oss) generates through the KV cache
(`titan_models.kv_cache`). `generate(..., kv_cache=False)` instead runs the model's own forward over
the whole sequence at every step, one prompt at a time (that forward has no mask for left padding):
much slower, kept as the reference the cache is measured against (bench/generate_throughput.py).

A model whose forward holds collectives (an expert-parallel MoE, its experts split over ranks, trading
tokens by all-to-all) must run every forward on every rank: `generate(..., all_done=agree)` then steps
until `agree(this rank's rows are done)` says every rank's are, a rank whose rows ended stepping on with
padding (which its outputs never keep).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from titan_models.errors import ModelError
from titan_models.kv_cache import KVCache, _check_whole_model, forward_cached, supports_kv_cache

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. `temperature=0` is greedy; `top_k=0` and `top_p=1` are off.
    `row_seeds`, one per prompt, replace `seed`: each row samples from its own generator, so its tokens
    do not depend on which rows share its batch (a batch split over ranks draws what one batch draws)."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    row_seeds: tuple[int, ...] = ()
    eos_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ModelError(f"generation: max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ModelError(f"generation: temperature must be >= 0 (0: greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ModelError(f"generation: top_k must be >= 0 (0: off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ModelError(f"generation: top_p must be in (0, 1] (1: off), got {self.top_p}")
        if any(not s for s in self.stop_strings):
            raise ModelError("generation: stop strings must not be empty")


@dataclass
class Generation:
    """What `generate` produced, per prompt, with its timing.

    `tokens[i]`: the new ids of prompt i, ending before its end-of-sequence id or after the token
    that completed a stop string. `texts[i]` (with `decode`): their text, cut before the first stop
    string. `finish_reasons[i]`: "eos", "stop" or "length"; `end_ids[i]`: the id of `eos_ids` that ended
    row i, else None.
    """

    tokens: list[list[int]]
    finish_reasons: list[str]
    texts: list[str] | None = None
    end_ids: list[int | None] = field(default_factory=list)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    steps: int = 0
    prompt_tokens: int = 0
    new_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.new_tokens = sum(len(t) for t in self.tokens)

    @property
    def tokens_per_second(self) -> float:
        """New tokens over the whole generation (prefill included)."""
        seconds = self.prefill_seconds + self.decode_seconds
        return self.new_tokens / seconds if seconds > 0 else float("inf")


def sample_next(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
) -> torch.Tensor:
    """Next token ids (batch,) from last-position logits (batch, vocab); `generator` one for the batch or
    one per row."""
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    scores = logits.float() / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1:
        # Keep the smallest set of most likely tokens whose probability reaches top_p.
        ordered, order = torch.sort(scores, dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs
        ordered = ordered.masked_fill(before >= params.top_p, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(-1, order, ordered)
    probs = scores.softmax(dim=-1)
    if isinstance(generator, Sequence):
        rows = [torch.multinomial(probs[r : r + 1], 1, generator=g) for r, g in enumerate(generator)]
        return torch.cat(rows).squeeze(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _left_padded(
    prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    valid = torch.zeros((len(prompts), width), dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        if prompt:
            tokens[row, width - len(prompt) :] = torch.as_tensor(list(prompt), dtype=torch.long)
            valid[row, width - len(prompt) :] = True
    return tokens.to(device), valid.to(device)


def _first_stop(text: str, stop_strings: Sequence[str]) -> int:
    """Index of the earliest stop string in `text`, or -1."""
    found = [i for i in (text.find(s) for s in stop_strings) if i >= 0]
    return min(found) if found else -1


class _Cached:
    """Forwards through the KV cache: the prompt once, then one new token a step."""

    def __init__(self, model: nn.Module, tokens: torch.Tensor, valid: torch.Tensor, max_new_tokens: int):
        self.model, self.tokens, self.valid = model, tokens, valid
        self.cache = KVCache.for_model(model, tokens.shape[0], tokens.shape[1] + max_new_tokens)

    def prefill(self) -> torch.Tensor:
        return forward_cached(self.model, self.tokens, self.cache, self.valid)

    def extend(self, nxt: torch.Tensor) -> torch.Tensor:
        return forward_cached(self.model, nxt[:, None], self.cache)


class _Recomputed:
    """Forwards of the model's own `forward` over the whole sequence so far (one row, no padding)."""

    def __init__(self, model: nn.Module, tokens: torch.Tensor, valid: torch.Tensor, max_new_tokens: int):
        longest = tokens.shape[1] + max_new_tokens - 1
        if longest > model.args.max_seq_len:
            raise ModelError(
                f"model: generation needs {longest} positions but the model is built for "
                f"{model.args.max_seq_len} (max_seq_len); build it with a larger max_seq_len, or ask for fewer tokens"
            )
        self.model, self.tokens = model, tokens

    def prefill(self) -> torch.Tensor:
        return self.model(self.tokens)[:, -1]

    def extend(self, nxt: torch.Tensor) -> torch.Tensor:
        self.tokens = torch.cat([self.tokens, nxt[:, None]], dim=1)
        return self.model(self.tokens)[:, -1]


def has_kv_cache(model: nn.Module) -> bool:
    """Whether `generate` can run `model` through the KV cache: every attention brings its hook."""
    return supports_kv_cache(model)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams = SamplingParams(),
    *,
    decode: Callable[[list[int]], str] | None = None,
    pad_id: int = 0,
    kv_cache: bool = True,
    all_done: Callable[[bool], bool] | None = None,
) -> Generation:
    """Continue each prompt (a list of token ids) with `model`, a whole decoder in eval mode.

    `decode` turns ids into text: needed for `stop_strings`, and gives `Generation.texts`. `pad_id`
    fills the left padding (any id: padding is masked out). `kv_cache=False` recomputes every position
    at every step, one prompt at a time (a reference for measuring the cache). `all_done` makes ranks
    whose forwards hold collectives step together (see the module docstring).
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ModelError("generation: every prompt needs at least one token (e.g. the BOS id)")
    if params.stop_strings and decode is None:
        raise ModelError("generation: stop_strings need a decode function (token ids -> text)")
    if params.row_seeds and len(params.row_seeds) != len(prompts):
        raise ModelError(
            f"generation: {len(params.row_seeds)} row_seeds for {len(prompts)} prompts; give one per prompt, or none"
        )
    _check_whole_model(model)
    if kv_cache and has_kv_cache(model):
        return _generate(model, prompts, params, decode, pad_id, _Cached, all_done)
    if all_done is not None:
        raise ModelError(
            "generation: ranks stepping together (all_done) need the KV cache, which runs their rows as one "
            f"batch; {type(model).__name__} has an attention without a KV-cache hook"
        )
    if kv_cache:
        log.warning(
            "generation: %s has an attention without a KV-cache hook (`kv_cache`); every token recomputes its "
            "prompt's whole sequence, one prompt at a time",
            type(model).__name__,
        )
    one_each = [replace(params, row_seeds=(s,)) for s in params.row_seeds] or [params] * len(prompts)
    rows = [
        _generate(model, [p], one, decode, pad_id, _Recomputed)
        for p, one in zip(prompts, one_each, strict=True)
    ]
    return Generation(
        [t for r in rows for t in r.tokens],
        [f for r in rows for f in r.finish_reasons],
        None if decode is None else [t for r in rows for t in r.texts],
        end_ids=[e for r in rows for e in r.end_ids],
        prefill_seconds=sum(r.prefill_seconds for r in rows),
        decode_seconds=sum(r.decode_seconds for r in rows),
        steps=sum(r.steps for r in rows),
        prompt_tokens=sum(r.prompt_tokens for r in rows),
    )


def _generate(model, prompts, params, decode, pad_id, forwards, all_done=None) -> Generation:
    device = model.tok_embeddings.weight.device
    tokens, valid = _left_padded(prompts, pad_id, device)
    batch = tokens.shape[0]
    stepper = forwards(model, tokens, valid, params.max_new_tokens)
    generator = None
    if params.row_seeds and params.temperature > 0:
        generator = [torch.Generator(device=device).manual_seed(seed) for seed in params.row_seeds]
    elif params.seed is not None and params.temperature > 0:
        generator = torch.Generator(device=device).manual_seed(params.seed)
    eos = torch.tensor(params.eos_ids, dtype=torch.long, device=device)
    must_check = bool(params.eos_ids or params.stop_strings)

    started = time.perf_counter()
    logits = stepper.prefill()
    _sync(device)
    prefill_seconds = time.perf_counter() - started
    started = time.perf_counter()
    out = torch.full((batch, params.max_new_tokens), pad_id, dtype=torch.long, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    kept = [params.max_new_tokens] * batch  # new tokens of each row, before any cut
    reasons = ["length"] * batch
    steps = 0
    for step in range(params.max_new_tokens):
        nxt = torch.where(finished, pad_id, sample_next(logits, params, generator))
        out[:, step] = nxt
        steps = step + 1
        if must_check:
            hit_eos = torch.isin(nxt, eos) & ~finished
            for row in hit_eos.nonzero().flatten().tolist():
                kept[row], reasons[row] = step, "eos"
            finished |= hit_eos
            if params.stop_strings:
                for row in (~finished).nonzero().flatten().tolist():
                    if _first_stop(decode(out[row, :steps].tolist()), params.stop_strings) >= 0:
                        kept[row], reasons[row] = steps, "stop"
                        finished[row] = True
        done = bool(finished.all())
        if all_done is not None:
            done = all_done(done)
        if done:
            break
        if step + 1 < params.max_new_tokens:
            logits = stepper.extend(nxt)
    _sync(device)
    decode_seconds = time.perf_counter() - started

    rows = out[:, :steps].tolist()
    new = [row[: kept[i]] for i, row in enumerate(rows)]
    end_ids = [row[kept[i]] if reasons[i] == "eos" else None for i, row in enumerate(rows)]
    texts = None
    if decode is not None:
        texts = []
        for ids in new:
            text = decode(ids)
            cut = _first_stop(text, params.stop_strings) if params.stop_strings else -1
            texts.append(text if cut < 0 else text[:cut])
    return Generation(
        new,
        reasons,
        texts,
        end_ids=end_ids,
        prefill_seconds=prefill_seconds,
        decode_seconds=decode_seconds,
        steps=steps,
        prompt_tokens=int(valid.sum()),
    )
