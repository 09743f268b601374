"""The vllm rollout engine (`grpo.engine = "vllm"`): a vLLM server in its own environment (apps/vllm, whose
torch is vLLM's, not the trainer's) generates the completions and the log-prob of every sampled token.

Before each generation whose weights an optimizer step changed, every rank writes the policy as a Hugging
Face safetensors folder (Titan's own export, `titan_ckpt.hf_export`, as `checkpoint.last_save_in_hf`
writes it) under `dump_folder/vllm_weights/`; rank 0 then starts the server on that folder (the first
time) or has it reload the folder in place (vLLM's `reload_weights`), and drops the previous one. Every
rank then asks the server for its own prompts' completions. The server is `apps/vllm/serve.py`, started by
the run (and stopped when it exits) or reached at `grpo.vllm_url`.

A server that stops answering is waited for (`grpo.vllm_server_timeout`, retried with a growing pause); one
the run started and finds dead is restarted at once, on the same port and the weights it held, so every
rank's retry reaches it. If it does not answer again in time the run stops with `EngineFailed`: one line
naming the server, its last error and the checkpoint a resume starts from.
"""

from __future__ import annotations

import atexit
import json
import logging
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch
import torch.distributed as dist

from titan_ckpt import EXPORT_DTYPES, ModelState
from titan_ckpt.hf_export import write_hf_export
from titan_ckpt.hf_safetensors import DEFAULT_MAX_SHARD_BYTES
from titan_ckpt.step_folders import complete_steps, step_folder
from titan_models.generation import SamplingParams
from titan_train.objectives.off_policy import Background
from titan_train.objectives.rollouts import Completions
from titan_train.run_plan import RunPlan
from titan_train.wiring.checkpointing import hf_adapter_for
from titan_train.wiring.hf_interop import export_dtype, export_token_ids, hf_export_files

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 1800.0  # vLLM's start on 2 busy CPU cores takes minutes
REQUEST_TIMEOUT_S = 1800.0
MAX_RESTARTS = 3  # of a server the run started, before it stops trying
MAX_PAUSE_S = 30.0


class NotAnswering(RuntimeError):
    """The server did not answer a request (refused, reset, timed out): worth retrying."""


class EngineFailed(RuntimeError):
    """The rollout server stopped answering and did not come back: the run stops, its checkpoints kept."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _die_with_parent() -> None:
    """In the server's process: SIGTERM when the trainer that started it dies, even by SIGKILL (Linux)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start_server(
    project: str | Path,
    model: str | Path,
    *,
    max_model_len: int,
    gpu_memory_utilization: float,
    seed: int,
    dtype: str,
    log: Path,
    port: int = 0,
) -> tuple[subprocess.Popen, str]:
    """`project`'s serve.py on the Hugging Face folder `model`, in `project`'s own environment; its output
    goes to `log`. Returns the process and its URL once the engine is up (RuntimeError with the log's tail
    if it exits first)."""
    project = Path(project).resolve()
    port_file = log.with_suffix(".port")
    port_file.unlink(missing_ok=True)
    command = [
        str(project / ".venv" / "bin" / "python"),
        str(project / "serve.py"),
        "--model", str(model),
        "--port-file", str(port_file),
        "--port", str(port),
        "--max-model-len", str(max_model_len),
        "--gpu-memory-utilization", str(gpu_memory_utilization),
        "--seed", str(seed),
        "--dtype", dtype,
    ]  # fmt: skip
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent
        )
    deadline = time.monotonic() + START_TIMEOUT_S
    while not port_file.is_file():
        if process.poll() is not None or time.monotonic() > deadline:
            stop_server(process)
            tail = log.read_text(errors="replace").strip().splitlines()[-5:]
            raise RuntimeError(f"grpo: the vLLM server did not start (see {log}): {' | '.join(tail)}")
        time.sleep(1.0)
    time.sleep(0.2)  # the port is written before the file is closed
    return process, f"http://127.0.0.1:{int(port_file.read_text())}"


def stop_server(process: subprocess.Popen) -> None:
    """The server and its vLLM workers (its process group) stopped."""
    if process.poll() is None:
        try:
            import os

            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            process.kill()


def call(url: str, route: str, body: dict) -> dict:
    """One JSON request to the server; RuntimeError naming the URL and the server's error."""
    request = urllib.request.Request(
        url.rstrip("/") + route, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as err:
        raise RuntimeError(f"grpo: the vLLM server at {url} failed {route}: {err.read().decode()}") from None
    except (urllib.error.URLError, OSError) as err:
        raise NotAnswering(f"grpo: the vLLM server at {url} is not answering {route}: {err}") from None


class VLLMEngine:
    """The rollouts of a run from a vLLM server, kept on the policy's current weights."""

    def __init__(self, plan: RunPlan, tokenizer, dump: Path):
        config = plan.config
        self.plan, self.settings = plan, config.grpo
        self.adapter = hf_adapter_for(
            plan.family, plan.model_args, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id
        )
        self.files = hf_export_files(config, tokenizer.bos_id, tokenizer.eos_id)
        self.dtype_name = export_dtype(config)
        self.token_ids = export_token_ids(config)
        self.folder = dump / "vllm_weights"
        self.url: str | None = self.settings.vllm_url
        self.process: subprocess.Popen | None = None
        self.pushed: Path | None = None  # the folder the server holds
        self.pushed_step: int | None = None
        self.push_seconds = 0.0  # the last push's (the server's start included, the first time)
        self.restarts = 0
        self.checkpoints = (
            Path(config.job.dump_folder) / config.checkpoint.folder if config.checkpoint.enable else None
        )

    def push(self, parts, step: int) -> None:
        """The policy's weights after `step` optimizer steps written and loaded by the server (every rank)."""
        started = time.perf_counter()
        folder = self.folder / f"step-{step}"
        config = {**self.adapter.hf_config(), **self.token_ids, "torch_dtype": self.dtype_name}
        write_hf_export(
            folder,
            ModelState(parts).state_dict(),
            self.adapter,
            config,
            dtype=EXPORT_DTYPES[self.dtype_name],
            max_shard_bytes=DEFAULT_MAX_SHARD_BYTES,
            extra_files=self.files,
        )
        url = [None]
        if _rank() == 0:
            if self.url is None:
                self._start(folder)
            else:
                self._ask("/reload", {"path": str(folder.resolve())})
            for old in self.folder.glob("step-*"):  # the previous push (an earlier run's too)
                if old != folder:
                    shutil.rmtree(old, ignore_errors=True)
            url = [self.url]
        if dist.is_initialized():
            dist.broadcast_object_list(url, src=0)
        self.url, self.pushed, self.pushed_step = url[0], folder, step
        self.push_seconds = time.perf_counter() - started

    def _ask(self, route: str, body: dict) -> dict:
        """`call`, retried while the server does not answer (restarting one the run started that died),
        for up to grpo.vllm_server_timeout; `EngineFailed` after."""
        deadline, pause = time.monotonic() + self.settings.vllm_server_timeout, 1.0
        while True:
            try:
                return call(self.url, route, body)
            except NotAnswering as err:
                last = err
            if self.process is not None and self.process.poll() is not None and self.restarts < MAX_RESTARTS:
                self._restart(last)
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineFailed(self._failure(route, last)) from None
            time.sleep(min(pause, left))
            pause = min(2 * pause, MAX_PAUSE_S)

    def _restart(self, why: Exception) -> None:
        """The server the run started, found dead, started again on the same port and weights."""
        self.restarts += 1
        port = int(self.url.rsplit(":", 1)[1].rstrip("/"))
        logger.warning("grpo: %s; the vLLM server exited (status %s): restarting it on port %d (%d of %d)",
                       why, self.process.returncode, port, self.restarts, MAX_RESTARTS)  # fmt: skip
        try:
            self._start(self.pushed, port=port)
        except RuntimeError as err:
            raise EngineFailed(self._failure("a restart", err)) from None

    def _failure(self, route: str, err: Exception) -> str:
        latest = complete_steps(self.checkpoints) if self.checkpoints else []
        kept = (
            f"its checkpoints are kept (the last: {step_folder(self.checkpoints, latest[-1])}); resume with the "
            "same command"
            if latest
            else "no checkpoint was written yet"
            + ("" if self.checkpoints else " (checkpoint.enable is false)")
        )
        return (
            f"grpo: the vLLM server did not come back within grpo.vllm_server_timeout = "
            f"{self.settings.vllm_server_timeout:g} s ({self.restarts} restarts) for {route}: {err}; the run stops "
            f"here and {kept} once the server answers"
        )

    def _start(self, folder: Path, port: int = 0) -> None:
        g = self.settings
        self.process, self.url = start_server(
            g.vllm_project,
            folder.resolve(),
            max_model_len=g.max_prompt_length + g.max_completion_length,
            gpu_memory_utilization=g.vllm_gpu_memory_utilization,
            seed=self.plan.seed,
            dtype=self.dtype_name,
            log=self.folder / "server.log",
            port=port,
        )
        atexit.register(stop_server, self.process)

    def completions(
        self, parts, step: int, prompts: list[list[int]], num_generations: int, params: SamplingParams
    ) -> Completions:
        """`num_generations` completions of each prompt on the weights after `step` optimizer steps, with
        the log-prob vLLM sampled each token at."""
        return self.request(parts, step, prompts, num_generations, params).result()

    def request(
        self, parts, step: int, prompts: list[list[int]], num_generations: int, params: SamplingParams
    ) -> Background:
        """`completions`, with the weights pushed here (every rank: collectives) and the server's answer
        awaited in a background thread (`result()` joins it), so training can go on meanwhile."""
        self.push_seconds = 0.0
        if self.pushed_step != step:
            self.push(parts, step)
        return Background(lambda: self._generate(prompts, num_generations, params))

    def _generate(
        self, prompts: list[list[int]], num_generations: int, params: SamplingParams
    ) -> Completions:
        reply = self._ask(
            "/generate",
            {
                "prompts": prompts,
                "n": num_generations,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "top_k": params.top_k,
                "max_tokens": params.max_new_tokens,
                "stop_token_ids": list(params.eos_ids),
                "seeds": list(params.row_seeds),  # one per completion (completion_seeds), as the titan engine
            },
        )
        return Completions(reply["ids"], reply["truncated"], reply["logprobs"])

    def close(self) -> None:
        if self.process is not None:
            stop_server(self.process)
            self.process = None


def sampling_tensor(logprobs: list[list[float]], labels: torch.Tensor, rows: range) -> torch.Tensor:
    """(B, T) vLLM's log-probs of a micro-batch's completion tokens, where its labels are; 0 elsewhere."""
    out = torch.zeros(labels.shape, dtype=torch.float32)
    valid = labels.cpu() >= 0
    for r, k in enumerate(rows):
        out[r, valid[r]] = torch.tensor(logprobs[k], dtype=torch.float32)
    return out.to(labels.device)
