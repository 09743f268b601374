"""(Titan) The [optimizer.muon] section: the settings of Muon's group, read when optimizer.name = "Muon".

Names follow `torch.optim.Muon`'s arguments; the parameters Muon does not train (embedding, output
head, norms, biases, MoE routers) take AdamW's settings from [optimizer] (lr, beta1, beta2, eps,
weight_decay). `qk_clip_tau` is MuonClip's QK-clip threshold.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_train.config.fields import opt
from titan_train.errors import ConfigError


def _three_numbers(value: list[float]) -> None:
    if len(value) != 3:
        raise ConfigError(
            f"config: optimizer.muon.ns_coefficients has {len(value)} numbers; give three (a, b, c), "
            "e.g. 3.4445,-4.775,2.0315"
        )


@dataclass
class MuonSettings:
    lr: float | None = opt(
        None, "(Titan) Muon's learning rate before adjust_lr_fn; None: optimizer.lr", minimum=0, maximum=1.0
    )
    weight_decay: float | None = opt(
        None, "(Titan) Muon's decoupled weight decay; None: optimizer.weight_decay", minimum=0, maximum=10.0
    )
    momentum: float = opt(
        0.95, "(Titan) Muon's momentum factor (torch.optim.Muon's momentum)", minimum=0, below=1
    )
    nesterov: bool = opt(
        True, "(Titan) Orthogonalise the Nesterov look-ahead of the momentum, not the momentum"
    )
    ns_steps: int = opt(5, "(Titan) Newton-Schulz iterations per matrix", minimum=1, maximum=99)
    ns_coefficients: list[float] = opt(
        [3.4445, -4.775, 2.0315],
        "(Titan) Newton-Schulz polynomial coefficients (a, b, c): three numbers, each within [-100, 100]",
        minimum=-100.0,
        maximum=100.0,
        check=_three_numbers,
    )
    ns_dtype: str = opt(
        "bfloat16",
        "(Titan) The dtype Newton-Schulz runs in: bfloat16 (torch.optim.Muon's) or float32 (exact to float "
        "rounding; much faster on CPUs without bfloat16 matmul units)",
        choices=("bfloat16", "float32"),
    )
    eps: float = opt(1e-7, "(Titan) Floor of the Frobenius norm a matrix is divided by", above=0, maximum=1.0)
    adjust_lr_fn: str = opt(
        "original",
        "(Titan) Learning rate per matrix: original (x sqrt(max(1, rows/cols))) or match_rms_adamw "
        "(x 0.2 sqrt(max(rows, cols)), AdamW's lr and weight decay carry over)",
        choices=("original", "match_rms_adamw"),
    )
    qk_clip_tau: float | None = opt(
        None,
        "(Titan) MuonClip's QK-clip: after each step, scale the query and key rows of every attention head whose "
        "largest logit exceeded this so that its logits scale by tau / logit; None: off. Attention of plain "
        "query and key projections (MHA, GQA) or latent ones (MLA), no tensor or context parallelism",
        above=0,
        maximum=1e6,
    )
