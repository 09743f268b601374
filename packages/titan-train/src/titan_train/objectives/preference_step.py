"""One micro-batch of preference tuning: policy and reference log-probs per sequence, the pair loss,
its backward, and the step's metrics under TRL's names.

The step's loss is the mean over its pairs, whatever the layout: before the step the pairs (and, for
the NLL terms, the chosen tokens: the completion for rpo_alpha, the whole sequence for ORPO) of all its micro-batches are counted over the
data-parallel ranks, and each micro-batch backpropagates its pairs' sum times dp over that count, so
that data parallelism's gradient average and gradient accumulation's sum give the gradient of the
global mean, as one process computes it on the whole batch (the token loss does the same over tokens,
see valid_token_loss).

Under context parallelism each row is dealt to the ranks once its sequences are numbered (`deal`): every
rank sums the log-probs of its own tokens per sequence, and the sums (and, for ORPO's token NLL, its sum
and count) are added up over the context-parallel group before the loss, so each rank holds the pairs'
whole sums; the sum's backward hands each rank the gradient of its tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from torch import nn

from titan_data.preference.dataset import NO_SEQUENCE
from titan_parallel import adapters_off
from titan_train.config.preference_section import PreferenceLoss
from titan_train.config.schema import JobConfig
from titan_train.objectives.preference_loss import (
    IGNORE_INDEX,
    SequenceLogps,
    pair_losses,
    sequence_logps,
    token_logps,
)

METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


@contextlib.contextmanager
def evaluating(parts: list[nn.Module]):
    """The policy's parts in eval mode for a reference forward (adapters off, or the precompute pass):
    as the frozen copy, it must not count its routing into the experts' load-balancing statistics,
    which only training forwards feed."""
    modes = [part.training for part in parts]
    for part in parts:
        part.eval()
    try:
        yield
    finally:
        for part, mode in zip(parts, modes, strict=True):
            part.train(mode)


def global_sequences(sequence: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A batch's per-window sequence numbers (2k chosen, 2k+1 rejected) numbered across the batch, and
    its number of pairs."""
    pairs = (sequence.amax(dim=1) + 1) // 2
    offsets = torch.cumsum(pairs, 0) - pairs
    numbered = torch.where(sequence >= 0, sequence + 2 * offsets[:, None], NO_SEQUENCE)
    return numbered, int(pairs.sum())


def window_slots(sequence: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per window (row), a per-sequence value at column j for the row's j-th sequence (float64, 0 past its
    last): `values` holds it at each of that sequence's positions (`sequence`: -1 where none)."""
    seq_len = sequence.shape[-1]
    slot = torch.where(sequence >= 0, sequence, seq_len)
    slots = values.new_zeros(*sequence.shape[:-1], seq_len + 1, dtype=torch.float64)
    return slots.scatter(-1, slot, values.to(torch.float64))[..., :seq_len]


def whole_chosen_labels(inputs: torch.Tensor, labels: torch.Tensor, sequence: torch.Tensor) -> torch.Tensor:
    """The targets of ORPO's NLL term, which ORPOTrainer takes over the whole chosen sequence, prompt
    included (every token after its first), not over its completion only as rpo_alpha's term: in a chosen
    sequence (even number), each position's label where it has one, else the next input of the same
    sequence; IGNORE_INDEX elsewhere."""
    chosen = (sequence >= 0) & (sequence % 2 == 0)
    next_inputs = torch.full_like(inputs, IGNORE_INDEX)
    same = sequence[..., :-1] == sequence[..., 1:]
    next_inputs[..., :-1] = torch.where(same, inputs[..., 1:], IGNORE_INDEX)
    return torch.where(chosen, torch.where(labels != IGNORE_INDEX, labels, next_inputs), IGNORE_INDEX)


class PreferenceStep:
    """The preference loss of a run: `begin_step` counts, `forward_backward` per micro-batch, `end_step`
    gathers the metrics. `reference` is a frozen model built like the policy (None: adapters off, log-probs
    computed before step 1 into `precomputed`, or a reference-free loss)."""

    def __init__(
        self,
        config: JobConfig,
        parts: list[nn.Module],
        reference: list[nn.Module] | None,
        forward: Callable,
        *,
        seq_len: int,
        dp_degree: int,
        group: dist.ProcessGroup | None,
        precomputed=None,
        pp_group: dist.ProcessGroup | None = None,
        deal: Callable | None = None,
        cp_group: dist.ProcessGroup | None = None,
    ):
        self.precomputed = precomputed  # a PrecomputedReference, read by each pair's dataset index
        self.loss, self.parts, self.reference, self.forward = (
            PreferenceLoss.of(config.preference),
            parts,
            reference,
            forward,
        )
        self.seq_len, self.dp_degree, self.group = seq_len, dp_degree, group
        self.pp_group = pp_group  # under a pipeline the metrics add up on the last stage's rank only
        # Under context parallelism: deal(batch, positions) deals the rows, and sums add up over cp_group.
        self.deal, self.cp_group = deal, cp_group
        self.needs_reference, self.nll_weight = self.loss.needs_reference, self.loss.nll_weight
        if len(parts) != 1 and pp_group is None:
            raise ValueError("PreferenceStep: several model parts need the pipeline's group (pp_group)")

    def begin_step(self, step_batches: list[tuple[torch.Tensor, ...]]) -> None:
        pairs = sum(int(((seq.amax(dim=1) + 1) // 2).sum()) for _, _, _, seq, *_ in step_batches)
        chosen_tokens = 0
        for inputs, labels, _, seq, *_ in step_batches:
            if self.loss.nll_over_whole_chosen:
                chosen_tokens += int((whole_chosen_labels(inputs, labels, seq) != IGNORE_INDEX).sum())
            else:
                chosen_tokens += int(((labels != IGNORE_INDEX) & (seq >= 0) & (seq % 2 == 0)).sum())
        counts = torch.tensor([pairs, chosen_tokens], dtype=torch.float64, device=step_batches[0][0].device)
        if self.group is not None:
            dist.all_reduce(counts, group=self.group)
        self.pairs, self.chosen_tokens = counts.clamp_min(1).tolist()
        self.sums = torch.zeros(len(METRICS) + 1, dtype=torch.float64, device=counts.device)

    def _reference_logps(self, inputs, labels, positions, sequence, n):
        if not self.needs_reference or self.precomputed is not None:
            return None
        with torch.no_grad():
            if self.reference is not None:
                logits = self.reference[0](inputs, positions=positions)
            else:
                with contextlib.ExitStack() as stack, evaluating(self.parts):
                    for part in self.parts:
                        stack.enter_context(adapters_off(part))
                    logits = self.forward(inputs, positions)
            return self._over_cp(sequence_logps(logits, labels, sequence, n).sums)

    def _over_cp(self, value: torch.Tensor) -> torch.Tensor:
        """`value` summed over the context-parallel ranks (differentiably: each rank gets its tokens'
        gradient), or as is without context parallelism."""
        if self.cp_group is None:
            return value
        return dist_nn.all_reduce(value, group=self.cp_group)

    def nll_targets(self, inputs, labels, sequence) -> torch.Tensor:
        """The NLL term's targets: ORPO's whole chosen sequences, else the labels (the completions)."""
        return whole_chosen_labels(inputs, labels, sequence) if self.loss.nll_over_whole_chosen else labels

    def _pair_terms(self, inputs, labels, positions, sequence, pair, seq_len: int):
        """`terms` of a batch, its logits from the policy's forward here."""
        sequence, pairs = global_sequences(sequence)
        inputs, labels, positions, sequence = [
            t.reshape(-1, seq_len) for t in (inputs, labels, positions, sequence)
        ]
        nll_targets = self.nll_targets(inputs, labels, sequence)  # of whole rows, before they are dealt
        dealt = [inputs, labels, positions, sequence, nll_targets]
        with self.deal(dealt, positions) if self.deal is not None else contextlib.nullcontext():
            reference = self._reference_logps(inputs, labels, positions, sequence, 2 * pairs)
            if self.needs_reference and self.precomputed is not None:
                reference = self.precomputed.lookup(pair.reshape(sequence.shape), sequence, 2 * pairs)
            logits = self.forward(inputs, positions)
            return self.terms(logits, labels, sequence, pairs, reference, nll_targets)

    def terms(self, logits, labels, sequence, pairs: int, reference, nll_targets):
        """Per pair of a batch (`sequence` numbered across it, `pairs` of them; `reference`: the reference's
        sum per sequence, or None): the losses and rewards; the chosen NLL's sum and token count; the
        metric values (their sums over the batch's pairs) and the number of pairs."""
        policy = sequence_logps(logits, labels, sequence, 2 * pairs)
        if self.cp_group is not None:
            policy = SequenceLogps(self._over_cp(policy.sums), self._over_cp(policy.counts))
        out = pair_losses(
            self.loss.kind,
            policy,
            None if reference is None else SequenceLogps(reference, policy.counts),
            beta=self.loss.beta,
            label_smoothing=self.loss.label_smoothing,
            simpo_gamma=self.loss.simpo_gamma,
        )
        nll, nll_tokens = out.losses.new_zeros(()), 0.0
        if self.nll_weight:
            if self.loss.nll_over_whole_chosen:
                nll = -self._over_cp(token_logps(logits, nll_targets).sum())
                nll_tokens = float(self._over_cp((nll_targets != IGNORE_INDEX).sum()))
            else:
                nll = -policy.sums[0::2].sum()
                nll_tokens = float(policy.counts[0::2].sum())
        chosen, rejected, n_chosen, n_rejected = policy.pairs()
        if self.loss.reports_average_logps:
            chosen, rejected = chosen / n_chosen.clamp_min(1), rejected / n_rejected.clamp_min(1)
        cr, rr = out.chosen_rewards, out.rejected_rewards
        values = (cr, rr, (cr > rr).float(), cr - rr, chosen.detach(), rejected.detach())
        metric_sums = torch.stack([v.sum().double() for v in values] + [cr.new_tensor(float(pairs)).double()])
        return out, nll, nll_tokens, metric_sums, pairs

    def step_loss(self, out, nll) -> torch.Tensor:
        """A micro-batch's share of the step's loss: its pairs' sum times dp over the step's pairs (the NLL
        term: over its chosen tokens)."""
        loss = out.losses.sum() * (self.dp_degree / self.pairs)
        if self.nll_weight:
            loss = loss + self.nll_weight * nll * (self.dp_degree / self.chosen_tokens)
        return loss

    def forward_backward(self, inputs, labels, positions, sequence, pair=None, *, context) -> torch.Tensor:
        """This micro-batch's share of the step's loss, backpropagated; returned detached. `pair`: each
        position's pair's index in the dataset, where the reference log-probs were precomputed."""
        with context():
            out, nll, _, metric_sums, _ = self._pair_terms(
                inputs, labels, positions, sequence, pair, self.seq_len
            )
            loss = self.step_loss(out, nll)
        loss.backward()
        self.sums += metric_sums
        return loss.detach()

    @torch.no_grad()
    def evaluate(self, inputs, labels, positions, sequence, *, seq_len: int, context) -> torch.Tensor:
        """One held-out batch's sums (float64): pair losses, chosen NLL, its tokens, the metrics, pairs."""
        with context():
            out, nll, nll_tokens, metric_sums, _ = self._pair_terms(
                inputs, labels, positions, sequence, None, seq_len
            )
        head = torch.stack([out.losses.sum().double(), nll.double(), nll.new_tensor(nll_tokens).double()])
        return torch.cat([head, metric_sums])

    def validation_metrics(self, sums: torch.Tensor) -> dict[str, float]:
        """The held-out set's loss and metrics from its sums over every batch (summed over data parallelism
        here): means over its pairs (the NLL term: over its chosen tokens), as the training step's."""
        if self.group is not None:
            dist.all_reduce(sums, group=self.group)
        losses, nll, nll_tokens, *metric_sums, pairs = sums.tolist()
        loss = losses / max(pairs, 1) + (
            self.nll_weight * nll / max(nll_tokens, 1) if self.nll_weight else 0.0
        )
        means = {name: value / max(pairs, 1) for name, value in zip(METRICS, metric_sums, strict=True)}
        return {"loss": loss, **means}

    def end_step(self) -> dict[str, float]:
        """The step's metrics, means over all its pairs (summed over data parallelism, and over the
        pipeline ranks, of which only the last stage's holds any)."""
        for group in (self.group, self.pp_group):
            if group is not None:
                dist.all_reduce(self.sums, group=group)
        *sums, count = self.sums.tolist()
        return {name: value / max(count, 1) for name, value in zip(METRICS, sums, strict=True)}


def build_reference(source: str | None, build: Callable[[], list[nn.Module]]) -> list[nn.Module] | None:
    """The frozen reference model's parts, built by `build` (the run's own model builder, so it is
    sharded like the policy) where `source` (`PreferenceLoss.reference_source`) is "copy", else None: a
    reference-free loss, the policy with adapters off, or log-probs precomputed before step 1 by the policy
    itself (see preference_reference). Its weights are the policy's starting weights, copied in by
    `copy_starting_weights` once they are loaded."""
    if source != "copy":
        return None
    parts = build()
    for part in parts:
        part.requires_grad_(False)
        part.eval()
    return parts


def copy_starting_weights(reference: list[nn.Module], parts: list[nn.Module]) -> None:
    """The policy's weights, as loaded before step 1, into the reference (shard by shard: both are laid
    out alike)."""
    with torch.no_grad():
        for ref, part in zip(reference, parts, strict=True):
            ref.load_state_dict(part.state_dict())
