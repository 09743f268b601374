"""(Titan) The [optimizer.muon] section: the settings of Muon's group, read when optimizer.name = "Muon".

Names follow `torch.optim.Muon`'s arguments; the parameters Muon does not train (embedding, output
head, norms, biases, MoE routers) take AdamW's settings from [optimizer] (lr, beta1, beta2, eps,
weight_decay). `qk_clip_tau` is MuonClip's QK-clip threshold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


def check_muon(config: Any) -> None:
    """Muon's rules across sections: QK-clip only with Muon and with every head and its keys whole on a rank,
    and Muon's whole-matrix step not split into the per-parameter steps of a step in backward. What the
    model's attention allows is the plan's to judge (`titan_train.step.muon_after_step.qk_clip_problems`)."""
    o, p = config.optimizer, config.parallelism
    where = "config: optimizer.muon.qk_clip_tau"
    if o.name == "Muon" and o.early_step_in_backward:
        raise ConfigError(
            "config: optimizer.name = 'Muon' orthogonalises whole matrices after the whole backward; "
            "optimizer.early_step_in_backward steps each parameter alone: unset one of them"
        )
    if o.muon.qk_clip_tau is None:
        return
    if o.name != "Muon":
        raise ConfigError(f"{where} is Muon's QK-clip (MuonClip); set optimizer.name = 'Muon' or unset it")
    for degree, name in ((p.tensor_parallel_degree, "tensor"), (p.context_parallel_degree, "context")):
        if degree > 1:
            raise ConfigError(
                f"{where}: QK-clip needs each attention head and its keys whole on a rank, and {name} "
                f"parallelism ({degree}) splits them; unset qk_clip_tau or train without {name} parallelism"
            )
