"""Titan's rollout server: one vLLM engine behind a small JSON-over-HTTP interface, run by this folder's own
environment (`apps/vllm/.venv/bin/python apps/vllm/serve.py --model FOLDER`), so vLLM's pinned torch never
meets the trainer's. titan-train starts it for `grpo.engine = "vllm"` (or reaches one at `grpo.vllm_url`).

- `POST /generate` {prompts: [[ids]], n, temperature, top_p, top_k, max_tokens, stop_token_ids, seeds}:
  `n` completions per prompt, prompt after prompt, each sampled with its own seed of `seeds` (one per
  completion, in that order; unseeded without them), each with its token ids, the log-prob of every sampled
  token (vLLM's processed log-probs: after temperature, as the trainer scores them) and whether it ended
  at `max_tokens` (`truncated`).
- `POST /reload` {path}: the model's weights reloaded in place from the safetensors of `path` (the same
  architecture; vLLM's `reload_weights`), no restart.
- `GET /health`: 200 once the engine is up.

The port is written to `--port-file` once the engine is up (port 0 picks a free one). One request at a time:
the engine is not shared between threads.
"""

from __future__ import annotations

import argparse
import json
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a Hugging Face folder (config.json + safetensors)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--port-file", default=None, help="where to write the port once the engine is up")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.15)
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dtype", default="float32", help="the export's dtype (vLLM's auto picks bfloat16 on CPU)"
    )
    return parser.parse_args()


def _engine(args: argparse.Namespace):
    from vllm import LLM

    return LLM(
        model=args.model,
        skip_tokenizer_init=True,  # token ids in and out: the trainer's tokenizer is the one that counts
        dtype=args.dtype,
        enforce_eager=True,
        enable_prefix_caching=False,  # cached prompt states would outlive a weight reload
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        logprobs_mode="processed_logprobs",
        seed=args.seed,
    )


def _generate(llm, request: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    # One request per completion, each with its own seed: a completion then draws the same tokens whichever
    # other prompts share its batch (the ranks that split a step's prompts draw what one process draws).
    n = int(request["n"])
    seeds = (
        [int(s) for s in request["seeds"]]
        if request.get("seeds") is not None
        else [None] * (n * len(request["prompts"]))
    )
    if len(seeds) != n * len(request["prompts"]):
        raise ValueError(f"{len(seeds)} seeds for {len(request['prompts'])} prompts of {n} completions each")
    params = [
        SamplingParams(
            n=1,
            temperature=float(request["temperature"]),
            top_p=float(request["top_p"]),
            top_k=int(request["top_k"]),
            max_tokens=int(request["max_tokens"]),
            stop_token_ids=[int(i) for i in request["stop_token_ids"]],
            seed=seed,
            logprobs=0,  # the sampled token's own log-prob
            detokenize=False,
        )
        for seed in seeds
    ]
    prompts = [
        TokensPrompt(prompt_token_ids=[int(i) for i in p]) for p in request["prompts"] for _ in range(n)
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    ids, logprobs, truncated = [], [], []
    for output in outputs:
        for completion in output.outputs:
            tokens = list(completion.token_ids)
            ids.append(tokens)
            logprobs.append([step[t].logprob for t, step in zip(tokens, completion.logprobs, strict=True)])
            truncated.append(completion.finish_reason == "length")
    return {"ids": ids, "logprobs": logprobs, "truncated": truncated}


def _reload(llm, request: dict) -> dict:
    started = time.perf_counter()
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(request["path"])})
    llm.reset_prefix_cache()
    return {"seconds": time.perf_counter() - started}


def _handler(llm):
    routes = {"/generate": _generate, "/reload": _reload}

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._reply(200 if self.path == "/health" else 404, {"ok": self.path == "/health"})

        def do_POST(self) -> None:
            route = routes.get(self.path)
            if route is None:
                self._reply(404, {"error": f"no route {self.path}"})
                return
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            try:
                self._reply(200, route(llm, request))
            except Exception as err:  # the client shows it; the server keeps serving
                self._reply(500, {"error": f"{type(err).__name__}: {err}"})

        def log_message(self, format, *args) -> None:  # noqa: A002 (the base class's name)
            pass

    return Handler


def main() -> None:
    args = _parse()
    started = time.perf_counter()
    llm = _engine(args)
    server = HTTPServer((args.host, args.port), _handler(llm))
    port = server.server_address[1]
    print(f"titan-vllm: up on {args.host}:{port} after {time.perf_counter() - started:.1f} s", flush=True)
    if args.port_file:
        Path(args.port_file).write_text(str(port))
    server.serve_forever()


if __name__ == "__main__":
    main()
