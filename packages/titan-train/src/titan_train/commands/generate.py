"""`titan-train generate`: text from a checkpoint a run wrote (any layout) or a Hugging Face folder.

`titan-train generate --checkpoint outputs/checkpoint/step-1000 --prompt "Once upon a time"
--job.config_file run.toml`: the flags after the generation flags are the run's config and overrides,
which name the model flavor and the tokenizer. With `--chat`, each prompt is a user turn (or each line
of `--messages-file` a conversation) rendered with the run's chat template, and generation stops at
the template's end-of-turn token.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from titan_models import SamplingParams, generate
from titan_train.commands.chat_input import chat_prompts, read_messages_file
from titan_train.commands.checkpoint_model import (
    CHECKPOINT_FORMATS,
    DTYPES,
    CheckpointModel,
    load_checkpoint_model,
)
from titan_train.config import load_job_config
from titan_train.errors import ConfigError


def checkpoint_parser(prog: str, what: str) -> argparse.ArgumentParser:
    """A parser with the flags `generate` and `eval` share: which checkpoint, where, in what precision.

    Flags it does not know are the run's config and overrides (callers use `parse_known_args`)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=f"{what} Other flags are the run's config (--job.config_file) and overrides, as for training.",
    )
    parser.add_argument(
        "--checkpoint", required=True, help="a checkpoint step-N folder, or a Hugging Face folder"
    )
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when there is one, else cpu)")
    parser.add_argument(
        "--dtype", default="float32", choices=list(DTYPES), help="weights' dtype (default: float32)"
    )
    parser.add_argument(
        "--max-seq-len", type=int, help="positions the model is built for (default: the flavor's context)"
    )
    parser.add_argument(
        "--weights",
        default="auto",
        choices=CHECKPOINT_FORMATS,
        help="where a final save holds both: its DCP files or its Hugging Face export (default: auto, DCP first)",
    )
    return parser


def load_for(args: argparse.Namespace, config) -> CheckpointModel:
    """The checkpoint that `checkpoint_parser`'s flags name, loaded for `config`."""
    return load_checkpoint_model(
        config,
        args.checkpoint,
        device=torch.device(args.device) if args.device else None,
        dtype=args.dtype,
        max_seq_len=args.max_seq_len,
        weights=args.weights,
    )


def _parser() -> argparse.ArgumentParser:
    parser = checkpoint_parser("titan-train generate", "Generate text from a checkpoint.")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    parser.add_argument("--prompts-file", help="a text file with one prompt a line")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens; 0: off")
    parser.add_argument("--top-p", type=float, default=1.0, help="sample within probability p; 1: off")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    parser.add_argument("--no-bos", action="store_true", help="do not put BOS before each prompt")
    parser.add_argument(
        "--no-eos-stop", action="store_true", help="keep generating past the end-of-text token"
    )
    parser.add_argument("--batch-size", type=int, default=0, help="prompts per batch; 0: all at once")
    parser.add_argument(
        "--chat",
        action="store_true",
        help="each prompt is a user turn, rendered with the run's chat template (sft.chat_template or the "
        "tokenizer's); stop at the template's end-of-turn token",
    )
    parser.add_argument(
        "--messages-file",
        help='with --chat: a JSONL file, one conversation a line ({"messages": [...]} or a list of turns)',
    )
    return parser


def _prompts(args: argparse.Namespace) -> list[str]:
    if args.messages_file and not args.chat:
        raise ConfigError("generate: --messages-file holds conversations; add --chat")
    prompts = list(args.prompt)
    if args.prompts_file:
        path = Path(args.prompts_file)
        if not path.is_file():
            raise ConfigError(f"generate: --prompts-file {path} does not exist")
        prompts += [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts and not args.messages_file:
        raise ConfigError(
            "generate: no prompt; pass --prompt TEXT, --prompts-file FILE or --chat --messages-file FILE"
        )
    return prompts


def generate_main(argv: list[str]) -> int:
    args, rest = _parser().parse_known_args(argv)
    prompts = _prompts(args)
    config = load_job_config(rest, check_paths=True)
    loaded = load_for(args, config)
    tok = loaded.tokenizer
    stop_ids = () if args.no_eos_stop else (tok.eos_id,)
    if args.chat:
        conversations = [[{"role": "user", "content": p}] for p in prompts]
        conversations += read_messages_file(args.messages_file) if args.messages_file else []
        prompts = [c[-1]["content"] for c in conversations]
        chat_ids, end_of_turn = chat_prompts(config, tok, conversations)
        stop_ids = (end_of_turn, *stop_ids)
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        eos_ids=stop_ids,
        stop_strings=tuple(args.stop),
    )
    batch = args.batch_size or len(prompts)
    new_tokens, seconds = 0, 0.0
    for start in range(0, len(prompts), batch):
        texts = prompts[start : start + batch]
        if args.chat:
            ids = chat_ids[start : start + batch]
        else:
            ids = [tok.encode(text, bos=not args.no_bos) for text in texts]
        out = generate(loaded.model, ids, params, decode=tok.decode, pad_id=tok.eos_id)
        for i, (text, completion) in enumerate(zip(texts, out.texts, strict=True)):
            print(f"--- prompt {start + i + 1} ({out.finish_reasons[i]}, {len(out.tokens[i])} tokens)")
            print(f"{text}{completion}")
        new_tokens += out.new_tokens
        seconds += out.prefill_seconds + out.decode_seconds
    print(
        f"generated {new_tokens} tokens for {len(prompts)} prompts in {seconds:.2f} s: "
        f"{new_tokens / max(seconds, 1e-9):,.1f} tokens/s on {loaded.device} ({args.dtype})"
    )
    return 0
