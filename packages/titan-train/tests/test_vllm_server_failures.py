"""A rollout server that stops answering (issue 59): the run waits `grpo.vllm_server_timeout` for it, then stops
in one line naming the server's last error and the checkpoint a resume starts from, which it keeps.

The server here is one that has gone: a run resumed from a titan-engine checkpoint at step 1 is pointed at a
URL where nothing listens any more (a port the test held and closed), as a server at `grpo.vllm_url` that
died between two runs is. A server the run started itself and that dies mid-run is restarted on the same
port (test_grpo_vllm.py's runs kill theirs). Planted once: `EngineFailed` left out of the run's one-line
errors let the traceback through and the test failed.
"""

from __future__ import annotations

import logging
import socket
import time

from titan_train.cli import run

DEBUG = ["--job.config_file", "apps/configs/debug_grpo.toml", "--training.local_batch_size", "4"]
DEBUG += ["--grpo.num_generations", "2", "--grpo.max_completion_length", "4"]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_server_that_is_gone_stops_the_run_in_one_line_keeping_its_checkpoint(tmp_path, caplog):
    dump = ["--job.dump_folder", str(tmp_path), "--checkpoint.enable", "--checkpoint.interval", "1"]
    assert run([*DEBUG, *dump, "--training.steps", "1"]) == 0
    url = f"http://127.0.0.1:{_closed_port()}"
    vllm = ["--grpo.engine", "vllm", "--grpo.vllm_url", url, "--grpo.vllm_server_timeout", "3"]
    caplog.clear()
    started = time.monotonic()
    with caplog.at_level(logging.ERROR):
        assert run([*DEBUG, *dump, *vllm, "--training.steps", "3"]) == 2
    waited = time.monotonic() - started
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert line.startswith("grpo: the vLLM server did not come back within grpo.vllm_server_timeout = 3 s"), (
        line
    )
    assert f"{url} is not answering /reload" in line and "\n" not in line
    assert f"the last: {tmp_path / 'checkpoint' / 'step-1'}); resume with the same command" in line
    assert (tmp_path / "checkpoint" / "step-1").is_dir() and not (tmp_path / "checkpoint" / "step-2").exists()
    assert waited >= 3
