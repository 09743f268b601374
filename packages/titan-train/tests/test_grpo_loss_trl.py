"""GRPO's arithmetic (`titan_train.objectives.grpo_loss`) against TRL 1.16's GRPOTrainer on the same rollouts.

A tiny Llama saved by transformers here (`tiny_llama.save_tiny_llama`, nothing downloaded) and the bundled
tokenizer. TRL's `GRPOTrainer._compute_loss` gets a batch of prompts and completions (random token ids, ragged
completion masks, groups of `num_generations`), its advantages, old and reference log-probs; Titan's loss takes
the per-token log-probs the same model gives and must equal TRL's loss and every parameter's gradient, for each
loss type, with and without the KL term, at token and sequence (GSPO) importance sampling. The advantages are
checked against TRL's reward-to-advantage code path on rewards with abstentions (None) and a whole-NaN row.

Planted once (2026-12-02): dr_grpo divided by the batch's token count instead of B x max_completion_length
fails `test_the_loss_and_gradients_equal_trls[dr_grpo-token-0.0]`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_llama import save_tiny_llama

from titan_train.objectives.grpo_loss import GRPOLoss, group_advantages
from titan_train.wiring.data import BUNDLED_TOKENIZER

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")

B, GENERATIONS, PROMPT, COMPLETION = 8, 4, 5, 7


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("grpo_model")
    save_tiny_llama(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_text((BUNDLED_TOKENIZER / name).read_text())
    return folder


def _trl_trainer(folder, tmp_path, **config):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=B,
        num_generations=GENERATIONS,
        max_completion_length=COMPLETION,
        report_to=[],
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        **config,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "a b c"}] * B),
        processing_class=AutoTokenizer.from_pretrained(folder),
    )
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def _rollouts(vocab: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    completion_mask = torch.ones(B, COMPLETION, dtype=torch.long)
    for row, length in enumerate([7, 3, 5, 1, 6, 7, 2, 4]):  # ragged: each completion ends where it stopped
        completion_mask[row, length:] = 0
    return {
        "prompt_ids": torch.randint(0, vocab, (B, PROMPT), generator=g),
        "prompt_mask": torch.ones(B, PROMPT, dtype=torch.long),
        "completion_ids": torch.randint(0, vocab, (B, COMPLETION), generator=g),
        "completion_mask": completion_mask,
        "advantages": torch.randn(B, generator=g),
        "num_items_in_batch": completion_mask.sum().float(),
        "jitter": torch.randn(2, B, COMPLETION, generator=g) * 0.1,
    }


def _completion_logps(model, inputs) -> torch.Tensor:
    """log p of each completion token under `model`, computed here from the logits."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, PROMPT - 1 : -1]
    return torch.gather(F.log_softmax(logits.float(), dim=-1), -1, inputs["completion_ids"].unsqueeze(-1))[
        ..., 0
    ]


def _grads(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


CASES = [
    ("grpo", "token", 0.0),
    ("bnpo", "token", 0.0),
    ("dr_grpo", "token", 0.0),
    ("dapo", "token", 0.0),
    ("dapo", "token", 0.04),
    ("dapo", "sequence", 0.0),
    ("cispo", "token", 0.0),
    ("sapo", "token", 0.0),
    ("grpo", "sequence", 0.04),
]


@pytest.mark.parametrize(("loss_type", "level", "beta"), CASES)
def test_the_loss_and_gradients_equal_trls(folder, tmp_path, one_rank, loss_type, level, beta):
    # `one_rank`: a process group of one already up, as accelerate (inside TRL) expects under pytest-xdist,
    # where a worker's environment may name a rank it would otherwise rendezvous on.
    trainer = _trl_trainer(
        folder, tmp_path, loss_type=loss_type, importance_sampling_level=level, beta=beta, epsilon_high=0.28
    )
    model = trainer.model
    model.train()
    inputs = _rollouts(model.config.vocab_size)
    with torch.no_grad():  # the rollout policy and the reference: the current weights, moved a little
        logps_now = _completion_logps(model, inputs)
    inputs["old_per_token_logps"] = logps_now + inputs["jitter"][0]
    if beta:
        inputs["ref_per_token_logps"] = logps_now + inputs["jitter"][1]
    trl_inputs = {k: v for k, v in inputs.items() if k != "jitter"}
    expected = trainer._compute_loss(model, trl_inputs)
    expected.backward()
    expected_grads = _grads(model)

    spec = GRPOLoss(
        loss_type=loss_type,
        beta=beta,
        epsilon=0.2,
        epsilon_high=0.28,
        importance_sampling=level,
        max_completion_length=COMPLETION,
    )
    mask = inputs["completion_mask"].float()
    logps = _completion_logps(model, inputs)
    per_token = spec.per_token(
        logps, inputs["old_per_token_logps"], inputs["advantages"], mask, inputs.get("ref_per_token_logps")
    )
    got = spec.reduce(per_token, mask, tokens_in_batch=float(inputs["num_items_in_batch"]))
    got.backward()
    got_grads = _grads(model)

    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    assert sorted(got_grads) == sorted(expected_grads)
    for name, grad in expected_grads.items():  # float noise: up to 1e-5 of each tensor's largest entry
        scale = float(grad.abs().max())
        torch.testing.assert_close(
            got_grads[name], grad, rtol=1e-4, atol=1e-5 * scale, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_trls_reward_path(scale):
    """TRL's `_generate_and_score_completions` math for rewards (sum_then_normalize), reproduced from its
    trainer's own helper `nanstd` and attributes, against `group_advantages` on rewards with abstentions."""
    from trl.trainer.utils import nanstd

    rewards_per_func = torch.tensor(
        [[1.0, 0.5], [0.0, float("nan")], [1.0, 1.0], [0.0, 0.0],
         [float("nan"), float("nan")], [1.0, 0.0], [0.5, 0.5], [0.0, 1.0]]
    )  # fmt: skip
    weights = torch.tensor([1.0, 0.5])
    advantages, rewards = group_advantages(rewards_per_func, weights, GENERATIONS, scale)

    expected_rewards = (rewards_per_func * weights).nansum(dim=1)
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    expected_rewards[unscorable] = float("nan")
    mean = torch.nanmean(expected_rewards.view(-1, GENERATIONS), dim=1).repeat_interleave(GENERATIONS)
    std = {
        "group": nanstd(expected_rewards.view(-1, GENERATIONS), dim=1).repeat_interleave(GENERATIONS),
        "batch": nanstd(expected_rewards).expand_as(expected_rewards),
        "none": None,
    }[scale]
    expected = expected_rewards - mean
    if std is not None:
        expected = expected / (std + 1e-4)
    expected[unscorable] = 0.0
    torch.testing.assert_close(rewards, expected_rewards, equal_nan=True)
    torch.testing.assert_close(advantages, expected)
    assert advantages[4] == 0.0 and not torch.isnan(advantages).any()
