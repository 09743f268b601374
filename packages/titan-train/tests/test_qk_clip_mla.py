"""QK-clip for DeepSeek-V3's multi-head latent attention, as Kimi K2's MuonClip defines it (arXiv 2507.20534,
section 2.1): per head h whose largest logit S_h exceeds tau, gamma_h = tau / S_h; the head-specific query and
key parts (q_nope: its rows of wq / wq_b; k_nope: its rows of wkv_b) scale by sqrt(gamma_h), its rotary query
(q_pe rows) by gamma_h, and the rotary key every head shares (wkv_a's last rows) not at all.

Every logit here is recomputed from the weights by `mla_logits` (the formulas written out, with DeepSeek's
YaRN softmax scale), never by Titan's attention. Planted once each, and each failed this test: q_pe's rows
scaled by sqrt(gamma) instead of gamma (the clipped head then peaked at 2.1x tau with wq, 1.8x with wq_a/wq_b;
4.9 relative off under FSDP); q_pe by sqrt(gamma) with the shared rotary key (wkv_a's rows) by sqrt(min gamma)
(wkv_a moved, heads under tau moved: 0.44 relative under FSDP); the record taken without YaRN's mscale
factor (recorded peaks 1/1.58 of the logits, and under FSDP only one head clipped); under FSDP, each rank
clipping by its own tokens' peaks (heads that peaked on the other rank missed: 0.14 relative).
"""

import json
from pathlib import Path

import pytest
import torch
from mla_logits import PLANTED_HEAD, peak_logits, tiny_mla, whole_weights

from titan_parallel import clip_latent_query_key
from titan_train.torchrun import run_torchrun

WORKER = Path(__file__).parent / "workers" / "qk_clip_mla_fsdp.py"


@pytest.mark.parametrize("q_lora_rank", [0, 12], ids=["wq", "wq_a_wq_b"])
def test_qk_clip_on_mla_scales_each_head_above_tau_to_it_and_leaves_the_others(q_lora_rank):
    """One process: the training forward records each head's largest whole logit (equal to the recomputed
    one, YaRN's scale included); after QK-clip the planted head's largest logit on that batch is tau,
    every other head's (block 1's too) is unchanged, and the weights moved exactly as K2's rule says."""
    model = tiny_mla(q_lora_rank)
    args = model.args
    inputs = {}
    for name, block in model.layers.items():
        block.attention.register_forward_pre_hook(
            lambda m, a, name=name: inputs.update({name: a[0].detach()})
        )
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    model.record_max_logits(True)
    model(tokens).sum().backward()  # a training pass: grad enabled
    heads = model.latent_query_key_heads()
    table = model.freqs_cis
    before = {n: whole_weights(model.layers[n].attention) for n in model.layers}
    peaks = {n: peak_logits(before[n], [inputs[n]], table, args) for n in model.layers}
    for n in model.layers:
        assert torch.allclose(heads[f"layers.{n}.attention"].max_logits, peaks[n], rtol=1e-5), n
    tau = float(peaks["0"][PLANTED_HEAD]) / 4
    assert (
        float(peaks["0"].sort().values[-2]) < tau and float(peaks["1"].max()) < tau
    )  # only the planted head

    clipped = clip_latent_query_key(model, tau)

    assert [(name, head) for name, head, _ in clipped] == [("layers.0.attention", PLANTED_HEAD)]
    after = {n: whole_weights(model.layers[n].attention) for n in model.layers}
    got = peak_logits(after["0"], [inputs["0"]], table, args)
    assert got[PLANTED_HEAD].item() == pytest.approx(tau, rel=1e-5)
    others = [h for h in range(args.n_heads) if h != PLANTED_HEAD]
    assert torch.allclose(got[others], peaks["0"][others], rtol=1e-5)
    assert torch.allclose(peak_logits(after["1"], [inputs["1"]], table, args), peaks["1"], rtol=1e-6)
    # The rule itself, on the weights: q_nope, k_nope by sqrt(gamma), q_pe by gamma, v and k_pe untouched.
    gamma = tau / float(peaks["0"][PLANTED_HEAD])
    nope, rope, v = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
    query = "wq.weight" if q_lora_rank == 0 else "wq_b.weight"
    expected_q, expected_kv = before["0"][query].clone(), before["0"]["wkv_b.weight"].clone()
    q0, kv0 = PLANTED_HEAD * (nope + rope), PLANTED_HEAD * (nope + v)
    expected_q[q0 : q0 + nope] *= gamma**0.5
    expected_q[q0 + nope : q0 + nope + rope] *= gamma
    expected_kv[kv0 : kv0 + nope] *= gamma**0.5
    assert torch.allclose(after["0"][query], expected_q, rtol=1e-6, atol=0)
    assert torch.allclose(after["0"]["wkv_b.weight"], expected_kv, rtol=1e-6, atol=0)
    for name in after["0"]:
        if name not in (query, "wkv_b.weight"):
            assert torch.equal(after["0"][name], before["0"][name]), name  # wkv_a: the shared k_pe
    assert all((a.max_logits == -torch.inf).all() for a in heads.values())  # the record restarts


@pytest.fixture(scope="module")
def fsdp_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("qk_clip_mla") / "result.json"
    result = run_torchrun(str(WORKER), str(out), nproc=2, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("q_lora_rank", ["0", "12"], ids=["wq", "wq_a_wq_b"])
def test_qk_clip_on_mla_under_fsdp_clips_by_the_largest_logit_over_every_ranks_tokens(
    fsdp_result, q_lora_rank
):
    """FSDP 2 (gloo), each rank its own tokens (so some heads peak only on rank 1), tau between the 4th and
    5th largest of the 8 heads' peaks (2 blocks, the planted head among those above): recomputed
    from the whole clipped weights over both ranks' inputs, every head above tau peaks at tau and the others
    keep their peak."""
    r = fsdp_result[q_lora_rank]
    assert (r["above_tau"], r["under_tau"]) == (4, 4), r
    assert r["peaks_only_on_rank_1"] > 0, r  # the max over ranks matters
    assert sorted(r["clipped_heads"]) == sorted(r["heads_above_tau"]), r
    assert r["difference"] <= 1e-5, r
