"""Muon in one process equals torch.optim.Muon: a checkpoint saved by transformers, trained 5 steps by
Titan with optimizer.name = "Muon", against a loop written here that trains the same weights with
`torch.optim.Muon` on the blocks' matrices and `torch.optim.AdamW` on the rest; MoE experts against
torch.optim.Muon on each expert's matrix (views of the stacked weight); QK-clip against Kimi K2's rule
computed by hand. The titan-train command's checks (dry run, refusals) are in test_muon_commands.py."""

import shutil
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from titan_models import Transformer, llama3_args, to_hf_config
from titan_models.qwen3 import QWEN3_FLAVORS, Qwen3Model, qwen3_moe_args
from titan_parallel import Muon, clip_grad_norm_, clip_query_key, muon_param_groups
from titan_train.plan import resolve
from titan_train.trainer import Trainer
from titan_train.wiring.data import BUNDLED_TOKENIZER

STEPS, LR = 5, 2e-3


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """A small Llama 3 (dim 64, 2 layers, 4 query heads over 2 key heads), random weights, saved by
    transformers with the bundled tokenizer."""
    folder = tmp_path_factory.mktemp("hf")
    args = replace(llama3_args("debugmodel"), dim=64, n_layers=2, n_heads=4, n_kv_heads=2)
    config = LlamaConfig(**{**to_hf_config(args), "max_position_embeddings": 16384})
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_TOKENIZER / name, folder / name)
    return folder


def _config(small_config, dump, folder, *more):
    return small_config(
        dump,
        "--model.flavor",
        "from_hf",
        "--checkpoint.enable",
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.initial_load_path",
        str(folder),
        "--model.hf_assets_path",
        str(folder),
        "--training.steps",
        str(STEPS),
        "--training.local_batch_size",
        "2",
        "--lr_scheduler.warmup_steps",
        "0",
        "--lr_scheduler.decay_ratio",
        "0",
        "--optimizer.lr",
        str(LR),
        "--optimizer.name",
        "Muon",
        *more,
    )


def _reference(model, batches, muon_kwargs, loss_fn=None, clip=torch.nn.utils.clip_grad_norm_):
    """`model` trained by torch.optim.Muon (the 2-D weights of the decoder layers, picked here by name)
    and torch.optim.AdamW (the rest), gradients clipped to norm 1 as Titan's training.max_norm does."""
    matrices = [p for name, p in model.named_parameters() if "layers." in name and p.ndim == 2]
    ids = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in ids]
    muon = torch.optim.Muon(matrices, lr=LR, weight_decay=0.1, **muon_kwargs)
    adamw = torch.optim.AdamW(rest, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    losses = []
    for inputs, labels in batches:
        logits = model(inputs)
        logits = logits.logits if hasattr(logits, "logits") else logits
        if loss_fn is None:
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        else:
            loss = loss_fn(logits, labels)
        loss.backward()
        clip(list(model.parameters()), 1.0)
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "flags,muon_kwargs",
    [
        ((), {"momentum": 0.95, "nesterov": True, "adjust_lr_fn": "original"}),
        (
            ("--optimizer.muon.adjust_lr_fn", "match_rms_adamw", "--optimizer.muon.no_nesterov"),
            {"momentum": 0.95, "nesterov": False, "adjust_lr_fn": "match_rms_adamw"},
        ),
    ],
    ids=["original-nesterov", "match_rms_adamw"],
)
def test_titan_muon_steps_equal_torch_muon_on_a_transformers_checkpoint(
    tmp_path, hf_checkpoint, small_config, one_rank, flags, muon_kwargs
):
    folder = hf_checkpoint
    config = _config(small_config, tmp_path / "run", folder, "--checkpoint.last_save_in_hf", *flags)
    trainer = Trainer(resolve(config, 1, "cpu"), one_rank)
    optimizer = trainer.optimizers.optimizers[0]
    assert isinstance(optimizer, Muon)
    assert [len(g["params"]) for g in optimizer.param_groups] == [
        14,
        7,
    ]  # 7 matrices a block; embed, 5 norms, head
    losses = trainer.train()

    # The same loop twice: on the model Titan imported from the checkpoint, with Titan's loss and clipping
    # (the same gradients to the bit, so the optimizers alone are compared: equal to 1e-5, in fact 0), and
    # on the transformers model itself (its own forward, loss and torch's clipping).
    peek = Trainer(
        resolve(_config(small_config, tmp_path / "peek", folder, "--training.steps", "0"), 1, "cpu"), one_rank
    )
    batches = _take(peek.loader, STEPS)
    peek.train()  # no steps: it loads the checkpoint
    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    start = {k: v.clone() for k, v in hf.state_dict().items()}
    hf_losses = _reference(hf, batches, muon_kwargs)
    imported = peek.model_parts[0]
    titan_losses = _reference(imported, batches, muon_kwargs, peek.loss_fn, clip_grad_norm_)

    assert losses == pytest.approx(titan_losses, abs=1e-5)
    assert losses == pytest.approx(hf_losses, rel=1e-5)
    trained = trainer.model_parts[0].state_dict()
    for name, weight in imported.state_dict().items():
        assert (trained[name] - weight).abs().max().item() <= 1e-5, name
    # Against the transformers model's loop: inputs that differ by float noise (1e-7) round differently
    # in Newton-Schulz's bfloat16, so the matrices agree to a share of the lr, not to 1e-5; and AdamW turns
    # that noise in a near-zero gradient (a rare token's embedding row) into a whole lr-sized step, so
    # its parameters agree but for a few elements.
    ours = load_file(tmp_path / "run" / "checkpoint" / f"step-{STEPS}" / "model-00001-of-00001.safetensors")
    for name, weight in hf.state_dict().items():
        difference = (ours[name] - weight).abs().flatten()
        share = 1.0 if ".layers." in name and weight.ndim == 2 else 0.999
        assert difference.quantile(share).item() <= 0.05 * LR * STEPS, name
    moved = (
        ours["model.layers.0.self_attn.q_proj.weight"] - start["model.layers.0.self_attn.q_proj.weight"]
    ).abs()
    assert moved.max().item() > 0.5 * LR  # the steps moved the matrices well beyond either tolerance


def _take(loader, n):
    batches = []
    for batch in loader:
        batches.append(batch)
        if len(batches) == n:
            return batches
    raise AssertionError("the loader ran out")


def _moe_model():
    """Qwen3-MoE at test size: 2 blocks of 8 experts (top 2), each expert's weights stacked [E, out, in]."""
    args = replace(
        QWEN3_FLAVORS["debugmodel_moe"],
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        moe_inter_dim=32,
        moe_args=qwen3_moe_args(8, 2),
    )
    model = Qwen3Model(args)
    model.init_weights(seed=0)
    return model


def test_each_expert_matrix_is_orthogonalised_on_its_own_as_torch_muon_does_it():
    """Titan's Muon on a MoE model against torch.optim.Muon given each expert's matrix as a view of the
    stacked weight (one Muon parameter per expert), the other block matrices whole, AdamW on the rest
    (embedding, head, norms, routers). Both models see the same batches, so gradients are equal."""
    ours, ref = _moe_model(), _moe_model()
    settings = {
        "lr": LR,
        "weight_decay": 0.1,
        "momentum": 0.95,
        "nesterov": True,
        "ns_coefficients": (3.4445, -4.775, 2.0315),
        "ns_steps": 5,
        "eps": 1e-7,
        "adjust_lr_fn": "original",
    }
    adamw = {"lr": LR, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    groups = muon_param_groups(ours, settings, adamw)
    assert [(g["muon"], g.get("stacked"), len(g["params"])) for g in groups] == [
        (True, 0, 8),  # wq wk wv wo in 2 blocks
        (True, 1, 6),  # experts' w1 w2 w3 in 2 blocks
        (False, None, 13),  # embedding, head, final norm; per block 2 norms, q and k norms, router
    ]
    titan = Muon(groups)

    stacked = {name: p for name, p in ref.named_parameters() if ".experts." in name}
    views = {name: [p.detach()[e] for e in range(p.shape[0])] for name, p in stacked.items()}
    whole = [p for name, p in ref.named_parameters() if "attention.w" in name]
    others = [p for name, p in ref.named_parameters() if name not in stacked and "attention.w" not in name]
    torch_muon = torch.optim.Muon(
        [v for vs in views.values() for v in vs] + whole, lr=LR, weight_decay=0.1, adjust_lr_fn="original"
    )
    torch_adamw = torch.optim.AdamW(others, **adamw)

    generator = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        tokens = torch.randint(0, ours.args.vocab_size, (2, 17), generator=generator)
        for model in (ours, ref):
            logits = model(tokens[:, :-1])
            F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        for name, p in stacked.items():
            for e, view in enumerate(views[name]):
                view.grad = p.grad[e]
        titan.step()
        torch_muon.step()
        torch_adamw.step()
        for model in (ours, ref):
            model.zero_grad()
    moved = 0.0
    start = _moe_model().state_dict()
    for name, weight in ref.state_dict().items():
        assert (ours.state_dict()[name] - weight).abs().max().item() <= 1e-5, name
        moved = max(moved, (weight - start[name]).abs().max().item())
    assert moved > 0.5 * LR


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_qk_clip_scales_a_planted_head_to_tau_as_kimi_k2_defines_it(kv_heads):
    """A query head planted 30x larger in block 0 exceeds tau; QK-clip (Kimi K2, section 2.1) scales
    its rows so that its logits scale by gamma = tau / S_max: with one key head per query head, query
    and key rows each by sqrt(gamma); with shared key heads, the key head by sqrt(min gamma of its
    query heads) and each query head by gamma / sqrt(that). The logits are computed here by hand; on
    the same batch the clipped head's largest logit is then tau, and the heads under tau keep theirs."""
    args = replace(llama3_args("debugmodel"), dim=64, n_layers=2, n_heads=4, n_kv_heads=kv_heads)
    model = Transformer(args)
    model.init_weights(seed=0)
    attention = model.layers["0"].attention
    head_dim = args.dim // args.n_heads
    with torch.no_grad():
        attention.wq.weight[head_dim : 2 * head_dim] *= 30.0  # query head 1
    inputs = {}
    attention.register_forward_pre_hook(lambda m, a: inputs.update(x=a[0].detach()))
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))

    def largest_logits() -> torch.Tensor:
        q, k, _ = attention.project(inputs["x"], model.freqs_cis)
        q, k = q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(args.n_heads // kv_heads, dim=1)
        scores = q @ k.transpose(-2, -1) / head_dim**0.5
        causal = torch.ones(32, 32, dtype=torch.bool).tril()
        return scores.masked_fill(~causal, -torch.inf).amax(dim=(0, 2, 3))

    model.record_max_logits(True)
    model(tokens)
    with torch.no_grad():
        peaks = largest_logits()
    tau = float(peaks[1]) / 4  # only the planted head is above it
    assert (peaks[[0, 2, 3]] < tau).all()
    assert torch.allclose(attention.max_logits, peaks, rtol=1e-5)
    wq, wk = attention.wq.weight.detach().clone(), attention.wk.weight.detach().clone()

    clipped = clip_query_key(model, tau)

    assert [(name, head) for name, head, _ in clipped] == [("layers.0.attention", 1)]
    gamma = tau / float(peaks[1])
    q_rows, k_rows = slice(head_dim, 2 * head_dim), slice(0, head_dim)  # head 1 reads key head 0 either way
    expected_wq, expected_wk = wq.clone(), wk.clone()
    if kv_heads == args.n_heads:  # K2's rule: sqrt(gamma) on each side
        k_rows = q_rows
        expected_wq[q_rows] *= gamma**0.5
    else:  # key head 0 serves query heads 0 and 1: min gamma is head 1's, so query head 1 gets gamma / sqrt(gamma)
        expected_wq[q_rows] *= gamma / gamma**0.5
        expected_wq[0:head_dim] /= gamma**0.5  # head 0 keeps its logits: its key shrank by sqrt(gamma)
    expected_wk[k_rows] *= gamma**0.5
    assert torch.allclose(attention.wq.weight, expected_wq, rtol=1e-6, atol=0)
    assert torch.allclose(attention.wk.weight, expected_wk, rtol=1e-6, atol=0)
    with torch.no_grad():
        after = largest_logits()
    assert after[1].item() == pytest.approx(tau, rel=1e-5)
    keep = [0, 2, 3]
    assert torch.allclose(after[keep], peaks[keep], rtol=1e-5)
    assert (attention.max_logits == -torch.inf).all()  # the record restarts for the next step


@pytest.mark.parametrize("ns_dtype", ["float32", "bfloat16"])
def test_newton_schulz_runs_in_the_configured_dtype(ns_dtype):
    """`ns_dtype` is the dtype of the Newton-Schulz iterations: one Muon step (no momentum history,
    no weight decay, lr 1) moves a tall matrix by -sqrt(rows / cols) times the quintic iteration of its
    gradient, written here in float64 from the definition (X = G^T / ||G||, then 5 times A = X X^T,
    X = aX + (bA + cA^2)X). float32 lands within float32 rounding of it; bfloat16 (torch.optim.Muon's)
    a bfloat16 rounding away, which also shows the setting is read."""
    a, b, c = 3.4445, -4.775, 2.0315
    weight = torch.nn.Parameter(torch.zeros(48, 32))
    grad = torch.randn(48, 32, generator=torch.Generator().manual_seed(0))
    weight.grad = grad.clone()
    group = {"params": [weight], "muon": True, "stacked": 0, "lr": 1.0, "weight_decay": 0.0}
    group |= {"momentum": 0.0, "nesterov": False, "ns_coefficients": (a, b, c), "ns_steps": 5, "eps": 1e-7}
    Muon([{**group, "adjust_lr_fn": "original", "ns_dtype": ns_dtype}]).step()
    x = grad.double().T / grad.double().norm()
    for _ in range(5):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    expected = -((48 / 32) ** 0.5) * x.T
    error = (weight.detach().double() - expected).abs().max().item()
    if ns_dtype == "float32":
        assert error < 1e-5
    else:
        assert 1e-3 < error < 0.1
    with pytest.raises(Exception, match="ns_dtype='float16' is unknown"):
        Muon([{**group, "ns_dtype": "float16"}])
