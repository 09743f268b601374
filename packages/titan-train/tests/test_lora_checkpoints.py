"""Adapter-only checkpoints of a LoRA run over a base imported from Hugging Face files: periodic saves hold
the adapters, their optimizer state and the run's state, not the base; a run killed with SIGKILL resumes
from one (the base read again from its Hugging Face files) with the losses of an uninterrupted run (the
killed run's own, logged before it died: one run fewer, for CI's time); a
resume whose base is gone is refused at start in one line. The same holds for QLoRA (`lora.quantize_base =
"nf4"`): the resume reads the base again and quantises it into the same NF4 codes, also under FSDP 2 (2 ranks)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_lora import FAMILIES, _save_hf_model
from torch.distributed.checkpoint import FileSystemReader

from titan_ckpt.frozen_base import FROZEN_BASE_FILE

REPO = Path(__file__).resolve().parents[3]
STEPS = 6


def _command(dump: Path, hf: Path, base: Path, *more: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "titan_train.cli",
        "--job.dump_folder",
        str(dump),
        "--model.name",
        "llama3",
        "--model.flavor",
        "from_hf",
        "--model.hf_assets_path",
        str(hf),
        "--model.converters",
        "lora",
        "--lora.rank",
        "4",
        "--lora.target_modules",
        "all-linear",
        "--lora.dropout",
        "0.1",  # the resumed run must draw the uninterrupted run's dropout masks
        "--checkpoint.enable",
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.initial_load_path",
        str(base),
        "--checkpoint.interval",
        "3",
        "--checkpoint.keep_latest_k",
        "0",
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
        "2",
        "--training.steps",
        str(STEPS),
        "--activation_checkpoint.mode",
        "none",
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard",
        "false",
        "--metrics.disable_color_printing",
        "--lr_scheduler.warmup_steps",
        "2",
        "--optimizer.lr",
        "3e-3",
        *more,
    ]


def _run(command: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=900, env=env, cwd=REPO)


def _losses(dump: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in records}


def _bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


@pytest.mark.parametrize("quantize_base", ["", "nf4"])
def test_adapter_only_checkpoints_resume_after_sigkill_with_the_uninterrupted_losses(tmp_path, quantize_base):
    hf, base = tmp_path / "hf", tmp_path / "base"
    _save_hf_model(hf, FAMILIES["llama3"]())
    shutil.copytree(hf, base)
    qlora = ("--lora.quantize_base", quantize_base, "--lora.nf4_scaler_block_size", "8")

    # SIGKILL after step 5 (the fault drill kills the process itself): step-3 is the newest checkpoint. Up to
    # its death the run is the uninterrupted run: its losses of steps 4 and 5 are what the resume must log.
    killed = tmp_path / "killed"
    crash = _run(_command(killed, hf, base, *qlora, "--health.drill", "kill", "--health.drill_step", "5"))
    assert crash.returncode == -9, crash.stderr[-3000:]
    expected = _losses(killed)
    assert sorted(expected) == [1, 2, 3, 4, 5]

    # Periodic saves hold no base weight (the last save, below, holds the whole model).
    step3 = killed / "checkpoint" / "step-3"
    record = json.loads((step3 / FROZEN_BASE_FILE).read_text())
    assert record["initial_load_path"] == str(base.resolve()) and record["initial_load_in_hf"]
    keys = set(FileSystemReader(str(step3)).read_metadata().state_dict_metadata)
    model_keys = {
        k
        for k in keys
        if k.split(".", 1)[0] not in ("optimizer", "lr_scheduler", "dataloader", "train_state")
    }
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)
    assert {
        k.split(".state.", 1)[1].rsplit(".", 1)[0] for k in keys if k.startswith("optimizer.state.")
    } == model_keys

    resumed = _run(_command(killed, hf, base, *qlora))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    log = resumed.stdout + resumed.stderr
    assert "resuming from step-3" in log
    assert f"reading the frozen base from {base.resolve()}" in log
    got = _losses(killed)  # the resumed run's lines come later and win
    assert sorted(got) == list(range(1, STEPS + 1))
    assert [got[s] for s in (4, 5)] == [expected[s] for s in (4, 5)]
    last = killed / "checkpoint" / f"step-{STEPS}"
    assert not (last / FROZEN_BASE_FILE).exists()
    assert "layers.0.attention.wq.weight" in FileSystemReader(str(last)).read_metadata().state_dict_metadata
    assert _bytes(step3) < 0.1 * _bytes(last)

    # The base after the resumed run is the imported one, bit for bit (only adapters moved); QLoRA's last save
    # holds it as torchao's NF4 round trip of the imported weight gives it.
    from safetensors.torch import load_file
    from torchao.quantization import to_nf4

    merged_base = load_file(next(base.glob("*.safetensors")))
    down = merged_base["model.layers.1.mlp.down_proj.weight"]
    if quantize_base:
        assert not torch.equal(to_nf4(down, 64, 8).get_original_weight(), down)
        merged_base["model.layers.1.mlp.down_proj.weight"] = to_nf4(down, 64, 8).get_original_weight()
    saved = FileSystemReader(str(killed / "checkpoint" / f"step-{STEPS}"))
    names = [k for k in saved.read_metadata().state_dict_metadata if k == "layers.1.feed_forward.w2.weight"]
    state = {n: torch.empty(merged_base["model.layers.1.mlp.down_proj.weight"].shape) for n in names}
    torch.distributed.checkpoint.load(
        state, checkpoint_id=str(killed / "checkpoint" / f"step-{STEPS}"), no_dist=True
    )
    assert torch.equal(
        state["layers.1.feed_forward.w2.weight"], merged_base["model.layers.1.mlp.down_proj.weight"]
    )

    if quantize_base:
        return
    # A resume whose base is gone stops at start, in one line (the run itself now loads from hf_assets_path:
    # the checkpoint names the folder its base came from).
    shutil.rmtree(killed / "checkpoint" / f"step-{STEPS}")
    shutil.rmtree(base)
    refused = _run(_command(killed, hf, base, "--checkpoint.initial_load_path", ""))
    assert refused.returncode == 2, refused.stderr[-3000:]
    errors = [line for line in (refused.stdout + refused.stderr).splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "step-3 holds the trained weights only" in errors[0], errors
    assert f"frozen base comes from {base.resolve()}" in errors[0] and "does not exist" in errors[0]


@pytest.mark.slow
def test_qlora_under_fsdp_resumes_an_adapter_only_save_with_the_uninterrupted_losses(tmp_path):
    """QLoRA on 2 ranks with FSDP 2: periodic saves hold only the adapters, the last one the NF4 base dequantised
    (torchao's round trip of the imported weight, gathered from FSDP's NF4 shards), and a run resumed from step 3
    (the base read again, quantised whole and re-sharded) logs the uninterrupted run's losses bit for bit."""
    from safetensors.torch import load_file
    from torchao.quantization import to_nf4

    from titan_train.torchrun import run_torchrun

    hf, base = tmp_path / "hf", tmp_path / "base"
    _save_hf_model(hf, FAMILIES["llama3"]())
    shutil.copytree(hf, base)
    fsdp = (
        "--lora.quantize_base",
        "nf4",
        "--lora.nf4_scaler_block_size",
        "8",
        "--parallelism.data_parallel_shard_degree",
        "2",
    )

    def launch(dump: Path, *more: str) -> str:
        command = _command(dump, hf, base, *fsdp, *more)[1:]  # "-m titan_train.cli ..." under torchrun
        done = run_torchrun(*command, nproc=2, timeout=900, cwd=REPO, env={"PYTHONUNBUFFERED": "1"})
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        return done.stdout + done.stderr

    whole = tmp_path / "uninterrupted"
    launch(whole)
    expected = _losses(whole)
    assert sorted(expected) == list(range(1, STEPS + 1))
    keys = FileSystemReader(str(whole / "checkpoint" / "step-3")).read_metadata().state_dict_metadata
    model_keys = [
        k
        for k in keys
        if k.split(".", 1)[0] not in ("optimizer", "lr_scheduler", "dataloader", "train_state")
    ]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)

    resumed = tmp_path / "resumed"
    log = launch(
        resumed,
        "--checkpoint.folder",
        str(whole / "checkpoint"),
        "--checkpoint.load_step",
        "3",
        "--checkpoint.load_only",
    )
    assert "resuming from step-3" in log and f"reading the frozen base from {base.resolve()}" in log
    got = _losses(resumed)
    assert [got[s] for s in (4, 5, 6)] == [expected[s] for s in (4, 5, 6)]

    down = load_file(next(base.glob("*.safetensors")))["model.layers.1.mlp.down_proj.weight"]
    state = {"layers.1.feed_forward.w2.weight": torch.empty(down.shape)}
    torch.distributed.checkpoint.load(
        state, checkpoint_id=str(whole / "checkpoint" / f"step-{STEPS}"), no_dist=True
    )
    assert torch.equal(state["layers.1.feed_forward.w2.weight"], to_nf4(down, 64, 8).get_original_weight())
