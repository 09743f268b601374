"""A run that starts from a Hugging Face folder and exports to one keeps each rank's host memory near its share
(issue 63): 4 ranks of FSDP on a Llama (hidden 1024, 4 blocks, 285 MB in fp32) that transformers saved in 120 MB
shards, 2 steps, `bench/hf_start_memory.py`'s runs, each rank's RSS sampled from /proc every 50 ms.

The bounds, as multiples of the model's fp32 bytes:
- spread: the highest rank's whole-run peak is at most 0.5 above the median rank's (the issue's bound);
- share: every rank's peak is at most 3.0 above the median rank's peak in a run that resumes the same weights
  from DCP and takes no step. What a rank adds is a quarter of the gradients and AdamW's two states, its quarter of the export
  and the step's buffers, which at this small size do not shrink with the model: measured 2.0-2.3 with the fix
  (against each rank's own baseline; the ranks' baselines differ by under 0.1).

Planted once (2026-12-02): glibc's kept heap on at the trainer's start and over the save and export again, as
before the fix: shares 3.9-4.7 on the four ranks (fails), spread 0.38 (passes at this size; at 1 GB it reached 0.65,
bench/RESULTS.md).
"""

from __future__ import annotations

import importlib.util
import shutil
import statistics
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("hf_start_memory", REPO / "bench" / "hf_start_memory.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench
_spec.loader.exec_module(bench)

RANKS, DIM, LAYERS, STEPS = 4, 1024, 4, 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_hf_start_and_export_keep_each_rank_within_half_a_model_of_the_median_and_three_above_a_dcp_resume(
    tmp_path,
):
    folder = tmp_path / "hf"
    model_bytes = bench.write_llama(folder, DIM, LAYERS)
    hf = ["--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", str(folder)]
    run = [*bench.common(folder, tmp_path / "run"), *hf]
    run += ["--training.steps", str(STEPS), "--checkpoint.last_save_in_hf"]
    peaks = bench.peak_rss_per_rank(bench.torchrun(RANKS, run), tmp_path / "run.log")
    saved = tmp_path / "run" / "checkpoint" / f"step-{STEPS}"
    resume = [*bench.common(folder, tmp_path / "resume"), "--checkpoint.initial_load_path", str(saved)]
    baseline = bench.peak_rss_per_rank(
        bench.torchrun(RANKS, [*resume, "--training.steps", "0"]), tmp_path / "r.log"
    )
    shutil.rmtree(tmp_path / "run")  # a GB of checkpoint and export

    # Every rank of both runs sampled. CI's workers lost one rank of a run three times: a pytest worker
    # that ran a Trainer in-process kept LOCAL_RANK=0, and a worker sampled between torchrun's fork and its
    # exec read as rank 0 for good; the bench now launches torchrun without those variables. The ranks'
    # baselines differ by under 0.1x the model: each rank's peak is held against their median.
    assert len(peaks) == RANKS and len(baseline) == RANKS, (peaks, baseline)
    base = statistics.median(baseline)
    shares = [(p - base) / model_bytes for p in peaks]
    spread = bench.spread(peaks, model_bytes)
    mib = [round(p / 2**20) for p in peaks]
    assert spread <= 0.5, (
        f"peak RSS per rank {mib} MiB: the highest is {spread:.2f}x the model above the median"
    )
    assert max(shares) <= 3.0, (
        f"peak RSS per rank {mib} MiB: {[round(s, 2) for s in shares]}x the model above DCP"
    )
