"""Muon through the titan-train command: the dry run counts Muon's optimizer state, and QK-clip where it
cannot act is refused at start in one line. (Each `run` makes and ends its own process group: these live
apart from test_muon.py's one-rank group.)"""

import logging
import re
from pathlib import Path

import pytest

from titan_train.cli import run


@pytest.mark.slow  # about 2 minutes on this loaded 2-core machine: 224 matrices go through Newton-Schulz, faked
def test_the_dry_run_counts_one_momentum_for_muon_matrices_and_two_moments_for_the_rest(caplog):
    """Llama 3 8B on 64 ranks with Muon: the traced optimizer state is one float32 buffer per element of
    the blocks' matrices and two (AdamW's moments) per element of the embedding, head and norms, sharded
    64 ways, where AdamW alone holds two for every element."""
    config_file = str(Path(__file__).parent / "fixtures" / "torchtitan_0.2_llama3_8b.toml")
    with caplog.at_level(logging.INFO, logger="titan_train.reporting.dry_run"):
        assert (
            run(["dry-run", "--ngpu", "64", "--job.config_file", config_file, "--optimizer.name", "Muon"])
            == 0
        )
    text = "\n".join(r.getMessage() for r in caplog.records if r.name == "titan_train.reporting.dry_run")
    rows = {name: float(gib) for name, gib in re.findall(r"^ +(\S[a-z ,]+?) +([\d.]+) GiB$", text, re.M)}
    params, vocab, dim, layers = 8_030_261_248, 128_256, 4096, 32
    elementwise = 2 * vocab * dim + (2 * layers + 1) * dim  # embedding, output, norms
    matrices = params - elementwise
    assert rows["optimizer state"] == round((matrices + 2 * elementwise) * 4 / 64 / 2**30, 2)


@pytest.mark.parametrize(
    "flags,says",
    [
        (
            ("--model.name", "qwen3", "--model.flavor", "debugmodel"),
            "config: optimizer.muon.qk_clip_tau: qwen3's attention logits are not q.k of plain linear projections",
        ),
        (("--optimizer.name", "AdamW"), "config: optimizer.muon.qk_clip_tau is Muon's QK-clip (MuonClip)"),
    ],
    ids=["qk-norm-family", "not-muon"],
)
def test_qk_clip_where_it_cannot_act_is_refused_in_one_line(tmp_path, caplog, flags, says):
    argv = ["--job.dump_folder", str(tmp_path), "--training.seq_len", "32", "--training.steps", "1"]
    argv += ["--optimizer.name", "Muon", "--optimizer.muon.qk_clip_tau", "100", *flags]
    with caplog.at_level(logging.ERROR):
        assert run(argv) == 2
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert line.startswith(says), line


@pytest.mark.parametrize(("flavor", "heads"), [("debugmodel", 96), ("kimi_k2_debugmodel", 32)])
def test_qk_clip_runs_on_deepseek_v3_mla_through_the_trainer(tmp_path, caplog, flavor, heads):
    """A deepseek_v3 run (MLA; Kimi K2's with a query latent) with a tau every head exceeds starts, and its
    first step clips every head of every block and says so (the weights' rule: test_qk_clip_mla.py)."""
    argv = ["--job.dump_folder", str(tmp_path), "--training.seq_len", "32", "--training.steps", "1"]
    argv += ["--model.name", "deepseek_v3", "--model.flavor", flavor, "--activation_checkpoint.mode", "none"]
    argv += ["--optimizer.name", "Muon", "--optimizer.muon.qk_clip_tau", "1e-6"]
    with caplog.at_level(logging.INFO, logger="titan_train.step.muon_after_step"):
        assert run(argv) == 0
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("qk-clip:")]
    start = f"qk-clip: step 1: {heads} heads above tau 1e-06 scaled to it: layers.0.attention head 0 ("
    assert line.startswith(start), line
