"""Initial standard deviations of an MoE layer's parameters (torchtitan 0.2.2's rule).

Model families draw each parameter from their own seeded, layout-independent generator; this says
only which normal distribution an MoE parameter comes from, so every family initialises MoE alike.
"""

from __future__ import annotations


def moe_init_std(name: str, depth_std: float) -> float | None:
    """Std of the truncated normal for `name` (a parameter name inside an MoE layer, e.g.
    "experts.w2" or "layers.3.moe.router.gate.weight"); None if it is not an MoE parameter.

    Input projections (`w1`) use 0.02; output-side projections (`w2`, `w3`) and the router gate use
    the block's depth-scaled std, as the dense feed-forward does. gpt-oss's biased experts
    (`mlp1_weight`, `mlp1_bias`, `mlp2_weight`, `mlp2_bias`) all use the depth-scaled std, as torchtitan's.
    """
    parts = name.split(".")
    if "router" in parts and "gate" in parts:
        return depth_std
    if "experts" in parts or "shared_experts" in parts:
        if "w1" in parts:
            return 0.02
        if "w2" in parts or "w3" in parts or parts[-1].startswith(("mlp1_", "mlp2_")):
            return depth_std
    return None
