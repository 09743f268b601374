"""What follows a Muon step: MuonClip's QK-clip (optimizer.muon.qk_clip_tau) and the log line of where the
optimizer step's time went (Newton-Schulz, gathering the split matrices whole for it, waiting for the gathers
not hidden under Newton-Schulz, and scattering the results back).

QK-clip reads the largest attention logit per head that the model kept during the step's forward
passes, the largest over the data-parallel ranks, and scales the query and key rows of the heads above
tau: `titan_parallel.clip_query_key` for a model answering `HasQueryKeyHeads` (MHA and GQA),
`clip_latent_query_key` for one answering `HasLatentQueryKeyHeads` (MLA). It needs every
head whole on a rank and every key a query attends to in the rank's own forward: tensor and context
parallelism split those, so they are refused at start, as are models answering neither (a norm after
the projections undoes a row scale).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch import nn

from titan_parallel import (
    HasLatentQueryKeyHeads,
    HasQueryKeyHeads,
    Muon,
    ParallelDims,
    clip_latent_query_key,
    clip_query_key,
)
from titan_train.config import JobConfig

logger = logging.getLogger(__name__)


def _clip_for(part: nn.Module) -> Callable | None:
    """The QK-clip that acts on `part`'s attention, by the protocol it answers; None if neither."""
    if isinstance(part, HasQueryKeyHeads):
        return clip_query_key
    if isinstance(part, HasLatentQueryKeyHeads):
        return clip_latent_query_key
    return None


def qk_clip_problems(config: JobConfig, model: nn.Module) -> list[str]:
    """QK-clip asked of a model whose attention logits are not q.k of plain projections, for the plan's
    check of the built (meta) model."""
    if config.optimizer.muon.qk_clip_tau is None or _clip_for(model) is not None:
        return []
    return [
        f"config: optimizer.muon.qk_clip_tau: {config.model.name}'s attention logits are not q.k of plain linear "
        "projections (a norm after them), so scaling rows cannot clip them; QK-clip supports attention whose "
        "model answers HasQueryKeyHeads or HasLatentQueryKeyHeads; unset qk_clip_tau"
    ]


class MuonAfterStep:
    """QK-clip after each applied step, where asked; Muon's time shares at each logged step."""

    def __init__(self, config: JobConfig, parts: list[nn.Module], optimizers: list, dims: ParallelDims):
        self.tau = config.optimizer.muon.qk_clip_tau
        self.parts = parts
        self.optimizers = [o for o in optimizers if isinstance(o, Muon)]
        self.group = None
        if self.tau is None:
            return
        # Muon, no tensor or context parallelism (config/muon_section.py) and a model it can clip
        # (`qk_clip_problems`, which the plan runs) were checked at start.
        self.clips = [_clip_for(part) for part in parts]
        for part in parts:
            part.record_max_logits(True)
        dp = dims.submesh("dp")
        self.group = dp.get_group() if dp is not None else None

    def after_step(self, step: int, applied: bool, log: bool) -> None:
        """Clip after an applied step (else only restart the logits' record); log Muon's time at `log` steps."""
        if self.tau is not None:
            for part, clip in zip(self.parts, self.clips, strict=True):
                if applied:
                    self._log_clipped(step, clip(part, self.tau, self.group))
                else:
                    part.record_max_logits(True)  # a fresh record at -inf
        if log and self.optimizers:
            self._log_time(step)

    def _log_clipped(self, step: int, clipped: list[tuple[str, int, float]]) -> None:
        if not clipped:
            return
        heads = ", ".join(f"{name} head {head} ({logit:.1f})" for name, head, logit in clipped)
        logger.info(
            "qk-clip: step %d: %d heads above tau %g scaled to it: %s", step, len(clipped), self.tau, heads
        )

    def _log_time(self, step: int) -> None:
        step_s = sum(o.timing.step_s for o in self.optimizers)
        ns_s = sum(o.timing.newton_schulz_s for o in self.optimizers)
        gather_s = sum(o.timing.gather_s for o in self.optimizers)
        scatter_s = sum(o.timing.scatter_s for o in self.optimizers)
        matrices = sum(o.timing.matrices for o in self.optimizers)
        gathered = sum(o.timing.gathered_bytes for o in self.optimizers)
        total = max(step_s, 1e-12)
        logger.info(
            "muon: to step %d: optimizer steps %.3f s, Newton-Schulz %.0f%% (%d matrices on this rank), "
            "gathering matrices whole %.0f%%, scattering them back %.0f%% (%.1f MB gathered)",
            step,
            step_s,
            100 * ns_s / total,
            matrices,
            100 * gather_s / total,
            100 * scatter_s / total,
            gathered / 1e6,
        )
        for optimizer in self.optimizers:
            optimizer.timing.reset()
