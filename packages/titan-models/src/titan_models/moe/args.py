"""The shape and routing policy of a mixture-of-experts feed-forward, checked when it is built."""

from __future__ import annotations

from dataclasses import dataclass

from titan_models.errors import ModelConfigError

SCORE_FUNCS = ("softmax", "sigmoid")


@dataclass
class MoEArgs:
    """Hyper-parameters of an MoE layer, with torchtitan 0.2.2's field names and defaults.

    Token-choice top-k routing: each token goes to `top_k` of `num_experts` routed experts (chosen by
    router score plus the load-balancing `expert_bias`), and always to the `num_shared_experts` shared
    ones. With `num_expert_groups`, experts form groups and a token only considers the
    `num_limited_groups` groups with the best top-2 scores (DeepSeek's node-limited routing).

    Load balancing: `load_balance_coeff` is the step size of the auxiliary-loss-free expert bias
    (None: no bias buffer); `update_bias` False keeps the buffer (checkpoints keep its FQN) but never
    moves it, as torchtitan 0.2.2's Qwen3 trainer, which registers no update; `seq_aux_loss_coeff`
    weighs DeepSeek-V3's sequence-wise balance loss (0: off).
    `debug_force_load_balance` routes round-robin (torchtitan's `debug.moe_force_load_balance`).
    """

    num_experts: int = 8
    num_shared_experts: int = 1
    score_func: str = "sigmoid"
    route_norm: bool = False
    route_scale: float = 1.0
    gate_bias: bool = False
    score_before_experts: bool = True
    top_k: int = 1
    num_expert_groups: int | None = None
    num_limited_groups: int | None = None
    use_grouped_mm: bool = True
    load_balance_coeff: float | None = 1e-3
    update_bias: bool = True
    seq_aux_loss_coeff: float = 0.0
    debug_force_load_balance: bool = False
    # Factor on the sequence-wise loss's gradient, fixed when the layer is built: 1 / the losses one optimizer
    # step backpropagates (gradient accumulation times pipeline microbatches), as each of them is scaled.
    aux_loss_scale: float = 1.0

    def __post_init__(self) -> None:
        check_moe_args(self)

    @property
    def experts_per_group(self) -> int:
        return self.num_experts // (self.num_expert_groups or 1)


def _refuse(field: str, message: str) -> None:
    raise ModelConfigError(f"model: moe.{field} {message}")


def check_moe_args(a: MoEArgs) -> None:
    """Refuse, in one line naming the field, arguments that cannot route tokens."""
    if a.num_experts < 1:
        _refuse("num_experts", f"({a.num_experts}) must be at least 1")
    if a.num_shared_experts < 0:
        _refuse("num_shared_experts", f"({a.num_shared_experts}) must be 0 or more")
    if a.score_func not in SCORE_FUNCS:
        _refuse("score_func", f"'{a.score_func}' is unknown; choose one of {', '.join(SCORE_FUNCS)}")
    if not 1 <= a.top_k <= a.num_experts:
        _refuse("top_k", f"({a.top_k}) must be between 1 and num_experts ({a.num_experts})")
    if a.route_scale <= 0:
        _refuse("route_scale", f"({a.route_scale}) must be positive")
    if a.load_balance_coeff is not None and a.load_balance_coeff <= 0:
        _refuse(
            "load_balance_coeff", f"({a.load_balance_coeff}) must be positive, or None for no expert bias"
        )
    if a.seq_aux_loss_coeff < 0:
        _refuse("seq_aux_loss_coeff", f"({a.seq_aux_loss_coeff}) must be 0 (off) or positive")
    if a.num_expert_groups is None:
        if a.num_limited_groups is not None:
            _refuse("num_limited_groups", "is set but num_expert_groups is not; set both or neither")
        return
    groups = a.num_expert_groups
    if groups < 1 or a.num_experts % groups:
        _refuse("num_expert_groups", f"({groups}) must divide num_experts ({a.num_experts})")
    if a.num_experts // groups < 2:
        # A group is scored by the sum of its best two experts.
        _refuse("num_expert_groups", f"({groups}) leaves fewer than 2 experts per group")
    if a.num_limited_groups is None or not 1 <= a.num_limited_groups <= groups:
        _refuse(
            "num_limited_groups",
            f"({a.num_limited_groups}) must be between 1 and num_expert_groups ({groups})",
        )
    if a.top_k > a.num_limited_groups * (a.num_experts // groups):
        _refuse(
            "top_k",
            f"({a.top_k}) exceeds the experts in num_limited_groups ({a.num_limited_groups}) groups of "
            f"{a.num_experts // groups}",
        )
