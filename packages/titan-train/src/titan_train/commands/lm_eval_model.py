"""A Titan model as an lm-evaluation-harness model, so any lm-eval task runs on a Titan checkpoint.

Needs the `eval` extra (`pip install 'titan-train[eval]'`). `TitanLM` follows the conventions of
lm-eval's own `hf` backend, so a checkpoint scores the same through either: a context is encoded with
BOS in front (as a tokenizer with a BOS does by default), a sequence longer than `max_length` loses tokens
on the left, continuations are scored with float32 log-softmax, generated text leaves out special
tokens and ends before the first stop sequence. Registered with lm-eval as `titan`:
`lm_eval --model titan --model_args config_file=run.toml,checkpoint=outputs/checkpoint/step-1000`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from torch import nn

from titan_data import Tokenizer
from titan_models import SamplingParams, generate
from titan_train.errors import ConfigError

DEFAULT_MAX_GEN_TOKS = 256  # as lm-eval's hf backend


def _batches(items: list, size: int) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


@register_model("titan")
class TitanLM(TemplateLM):
    """An lm-eval model over a Titan `Transformer` and tokenizer (or a checkpoint and the run's config).

    `max_length` caps a scored sequence (with a checkpoint, by default the positions its rotary table
    covers; with a model, give it); `add_bos_token` frames each context with BOS.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        tokenizer: Tokenizer | None = None,
        *,
        checkpoint: str | None = None,
        config_file: str | None = None,
        batch_size: int | str = 8,
        max_length: int | None = None,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        add_bos_token: bool = True,
        device: str | None = None,
        dtype: str = "float32",
        **unused,
    ):
        super().__init__()
        if model is None:
            model, tokenizer, max_seq_len = self._from_checkpoint(checkpoint, config_file, device, dtype)
            max_length = max_length or max_seq_len
        if tokenizer is None:
            raise ConfigError("eval: TitanLM needs the tokenizer the model was trained with")
        if not max_length:
            raise ConfigError("eval: TitanLM(model, ...) needs max_length, the longest sequence to score")
        self.model, self.titan_tokenizer = model.eval(), tokenizer
        self._device = next(model.parameters()).device
        self.batch_size = 8 if batch_size in ("auto", None) else int(batch_size)
        self._max_length = int(max_length)
        self._max_gen_toks = int(max_gen_toks)
        self.add_bos_token = add_bos_token
        self._special = tokenizer.special_ids
        # No BOS (a BOS-less tokenizer): no text stands for it, and contexts start without it.
        self._bos_text = None if tokenizer.bos_id is None else tokenizer.decode([tokenizer.bos_id])

    @staticmethod
    def _from_checkpoint(checkpoint, config_file, device, dtype) -> tuple[nn.Module, Tokenizer, int]:
        """For `lm_eval --model titan --model_args config_file=...,checkpoint=...`."""
        from titan_train.commands.checkpoint_model import load_checkpoint_model
        from titan_train.config import load_job_config

        if not checkpoint:
            raise ConfigError(
                "eval: --model_args needs checkpoint=PATH (a step-N folder or a Hugging Face folder)"
            )
        config = load_job_config(["--job.config_file", config_file] if config_file else [])
        loaded = load_checkpoint_model(
            config, checkpoint, device=torch.device(device) if device else None, dtype=dtype
        )
        return loaded.model, loaded.tokenizer, loaded.max_seq_len

    # -- what lm-eval asks of a model -----------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.titan_tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        # lm-eval's hf backend: BOS, or the end-of-text id for a tokenizer without one
        bos = self.titan_tokenizer.bos_id
        return self.titan_tokenizer.eos_id if bos is None else bos

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def device(self) -> torch.device:
        return self._device

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """Token ids of `string`, with BOS in front unless told otherwise (or the text starts with BOS's)."""
        bos = self.add_bos_token if add_special_tokens is None else add_special_tokens
        if add_special_tokens is None and self._bos_text and string.startswith(self._bos_text):
            string, bos = string[len(self._bos_text) :], True  # the BOS text is the BOS token
        return self.titan_tokenizer.encode(string, bos=bos)

    def tok_decode(self, tokens: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = [int(t) for t in tokens]
        if skip_special_tokens:
            ids = [t for t in ids if t not in self._special]
        return self.titan_tokenizer.decode(ids)

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """(sum of log-probabilities of the continuation, whether greedy decoding gives it) per request.

        A request is ((context, continuation) or None, context ids, continuation ids). Longest first,
        right-padded into batches: padding after a sequence never changes its causal logits.
        """
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        for chunk in _batches(order, override_bs or self.batch_size):
            inputs = []
            for i in chunk:
                _, context, continuation = requests[i]
                if not context or not continuation:
                    raise ConfigError("eval: a loglikelihood request needs context and continuation tokens")
                inputs.append((context + continuation)[-(self.max_length + 1) :][:-1])
            width = max(len(ids) for ids in inputs)
            tokens = torch.zeros((len(inputs), width), dtype=torch.long)
            for row, ids in enumerate(inputs):
                tokens[row, : len(ids)] = torch.tensor(ids)
            logprobs = F.log_softmax(self.model(tokens.to(self.device)).float(), dim=-1)
            for row, i in enumerate(chunk):
                key, _, continuation = requests[i]
                end = len(inputs[row])
                scored = logprobs[row, end - len(continuation) : end]
                target = torch.tensor(continuation, device=self.device)
                answer = (
                    float(scored.gather(-1, target[:, None]).sum()),
                    bool((scored.argmax(-1) == target).all()),
                )
                results[i] = answer
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole texts, scored in windows of `max_length` tokens (for perplexity tasks)."""
        totals = []
        for request in requests:
            (text,) = request.args
            windows = [
                (None, *make_disjoint_window(window))
                for window in get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            total = sum(ll for ll, _ in self._loglikelihood_tokens(windows))
            totals.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, as the task's generation kwargs say) continuations, cut at the stop sequences."""
        eos_text = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(i)
        outputs: list[str | None] = [None] * len(requests)
        for indices in groups.values():
            kwargs = normalize_gen_kwargs(requests[indices[0]].args[1], self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            max_new = kwargs.pop("max_gen_toks")
            if max_new >= self.max_length:
                raise ConfigError(
                    f"eval: the task asks for {max_new} new tokens, but max_length is {self.max_length}"
                )
            params = SamplingParams(
                max_new_tokens=max_new,
                temperature=float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0,
                top_k=int(kwargs.get("top_k") or 0),
                top_p=float(kwargs.get("top_p") or 1.0),
                seed=kwargs.get("seed"),
                eos_ids=(self.eot_token_id,),
                stop_strings=tuple(s for s in until if s),
            )
            # Longest first, so each batch's padding is small.
            ordered = sorted(indices, key=lambda i: -len(self.tok_encode(requests[i].args[0])))
            for chunk in _batches(ordered, self.batch_size):
                prompts = [
                    self.tok_encode(requests[i].args[0])[-(self.max_length - max_new) :] for i in chunk
                ]
                out = generate(self.model, prompts, params, decode=self.tok_decode, pad_id=self.eot_token_id)
                for i, ids in zip(chunk, out.tokens, strict=True):
                    text = postprocess_generated_text(self.tok_decode(ids), until, None)
                    outputs[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return outputs
