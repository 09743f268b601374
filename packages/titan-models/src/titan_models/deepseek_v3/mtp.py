"""DeepSeek-V3's multi-token prediction (technical report, section 2.2): D sequential modules after the
last block, module k predicting the token k + 1 places past the next one.

Module k at position i joins the previous depth's hidden state with the embedding of token i + k:
h'_i = eh_proj([enorm(Emb(t_{i+k})); hnorm(h^{k-1}_i)]) (embedding first, as the published weights
are laid out, though the paper writes h first), runs one decoder block over it, and its logits are the
shared output head after its own final norm. h^0 is the main model's last hidden state before the
final norm; the embedding and the output head are the main model's (the paper shares them).

Training sees the main logits and each depth's (B, T, V) logits concatenated along the sequence
(`titan_models.mtp_logits.split_mtp_logits` undoes it): depth k's position i trains on label i + k, so its last k positions,
which read wrapped-around tokens, weigh nothing (attention is causal: they change no earlier position).
The loss (lambda / D) * sum_k CE_k is added by the trainer's loss function; evaluation and generation
(the model in eval mode) see the main logits alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from titan_models.deepseek_v3.args import DeepSeekV3Args


class MultiTokenPrediction(nn.Module):
    """One MTP depth: the two input norms, the 2d -> d projection, a decoder block and its final norm."""

    def __init__(self, block: nn.Module, args: DeepSeekV3Args):
        super().__init__()
        self.enorm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.hnorm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.eh_proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.block = block
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)

    def forward(
        self, h: torch.Tensor, embedded: torch.Tensor, freqs_cis: torch.Tensor, masks: Any
    ) -> torch.Tensor:
        """This depth's hidden state (before its final norm) from the previous depth's and the
        embeddings of the tokens k places ahead."""
        joined = torch.cat([self.enorm(embedded), self.hnorm(h)], dim=-1)
        return self.block(self.eh_proj(joined), freqs_cis, masks)


class MultiTokenPredictionHead(nn.Module):
    """The D depths, keyed by the index Hugging Face gives their layer (n_layers, n_layers + 1, ...),
    which also sets their depth-scaled initialisation."""

    def __init__(self, args: DeepSeekV3Args, build_block: Callable[[int], nn.Module]):
        super().__init__()
        first = args.n_layers
        self.layers = nn.ModuleDict(
            {
                str(i): MultiTokenPrediction(build_block(i), args)
                for i in range(first, first + args.num_mtp_layers)
            }
        )

    def forward(
        self,
        h: torch.Tensor,
        embedded_ahead: Callable[[int], torch.Tensor],
        output: nn.Module,
        freqs_cis: torch.Tensor,
        masks: Any,
    ) -> list[torch.Tensor]:
        """Each depth's logits (B, T, V), from the main model's last hidden state `h` (before its final
        norm); `embedded_ahead(k)` holds Emb(t_{i+k}) at position i (the input's embeddings rolled k
        places back). Depth k's last k positions are padding (see the module)."""
        logits = []
        for k, depth in enumerate(self.layers.values(), start=1):
            h = depth(h, embedded_ahead(k), freqs_cis, masks)
            logits.append(output(depth.norm(h)))
        return logits
