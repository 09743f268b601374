"""A DeepSeek-V3 shape as Hugging Face's `config.json` (`DeepseekV3ForCausalLM`) states it: written, read, compared.

Hugging Face's DeepSeek-V3 routes with sigmoid scores and weights the experts' outputs (not inputs); it
rotates interleaved pairs (`rope_interleave`), the layout Titan uses, so no weight is permuted; its YaRN
applies whenever config.json names it; the norms on the query and key/value latents use eps 1e-6.
Anything it cannot express is refused with the field that differs.

Kimi K2's folders publish the same model under `model_type` "kimi_k2" (architectures still
DeepseekV3ForCausalLM, `auto_map` naming their copy of DeepSeek's code): read as DeepSeek-V3's. An export
writes `model_type` "deepseek_v3", which transformers loads without custom code.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from titan_models import hf_config_fields as shared
from titan_models.deepseek_v3.args import DeepSeekV3Args
from titan_models.errors import ModelConfigError
from titan_models.moe import MoEArgs

logger = logging.getLogger(__name__)

# DeepSeek's own, and Kimi K2's name for the same architecture.
MODEL_TYPES = ("deepseek_v3", "kimi_k2")
_ARCHITECTURE = "DeepseekV3ForCausalLM"
HF_LATENT_NORM_EPS = 1e-6  # DeepseekV3RMSNorm's default, which its q_a/kv_a layernorms keep
_DEFAULTS = {
    "model_type": "deepseek_v3",
    "hidden_act": "silu",
    "attention_bias": False,
    "rope_interleave": True,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "n_group": 8,
    "topk_group": 4,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 3,
    "n_shared_experts": 1,
    "q_lora_rank": 1536,
}
_REQUIRED = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "intermediate_size",
    "moe_intermediate_size",
    "n_routed_experts",
    "num_experts_per_tok",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)


def _export_problems(args: DeepSeekV3Args) -> list[str]:
    m = args.moe_args
    problems = []
    if m.score_func != "sigmoid":
        problems.append(f"moe.score_func '{m.score_func}' (DeepseekV3ForCausalLM routes with sigmoid only)")
    if m.score_before_experts:
        problems.append("moe.score_before_experts true (DeepseekV3ForCausalLM weights the experts' outputs)")
    if m.gate_bias:
        problems.append("moe.gate_bias true (DeepseekV3ForCausalLM's router has no bias)")
    if m.num_shared_experts < 1:
        problems.append("moe.num_shared_experts 0 (DeepseekV3ForCausalLM always has shared experts)")
    return problems


def _describe(args: DeepSeekV3Args) -> dict[str, Any]:
    """The config.json fields of `args`, whether or not Hugging Face can compute them."""
    m = args.moe_args
    config: dict[str, Any] = {
        "architectures": [_ARCHITECTURE],
        "model_type": "deepseek_v3",
        "hidden_size": args.dim,
        "intermediate_size": args.inter_dim,
        "moe_intermediate_size": args.moe_inter_dim,
        "num_hidden_layers": args.n_layers,
        "first_k_dense_replace": args.n_dense_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_heads,
        "vocab_size": args.vocab_size,
        "q_lora_rank": args.q_lora_rank or None,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "n_routed_experts": m.num_experts,
        "n_shared_experts": m.num_shared_experts,
        "num_experts_per_tok": m.top_k,
        "n_group": m.num_expert_groups or 1,
        "topk_group": m.num_limited_groups or 1,
        "norm_topk_prob": m.route_norm,
        "routed_scaling_factor": m.route_scale,
        # As DeepSeek-V3's published config.json says them: transformers assumes both, vLLM reads them
        # (without them it routes by softmax and holds no e_score_correction_bias).
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.context_len,
        "rope_theta": float(args.rope_theta),
        "rope_interleave": True,
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": args.num_mtp_layers,
    }
    if args.uses_yarn:
        config["rope_scaling"] = {
            "rope_type": "yarn",
            "factor": float(args.rope_factor),
            "beta_fast": float(args.beta_fast),
            "beta_slow": float(args.beta_slow),
            "mscale": float(args.mscale),
            "mscale_all_dim": float(args.mscale),
            "original_max_position_embeddings": args.original_seq_len,
        }
    return config


def _latent_eps(args: DeepSeekV3Args) -> float:
    return args.norm_eps if args.latent_norm_eps is None else args.latent_norm_eps


def to_hf_config(
    args: DeepSeekV3Args, *, bos_id: int | None = None, eos_id: int | None = None, dtype: str | None = None
) -> dict[str, Any]:
    """The `config.json` of the equivalent `DeepseekV3ForCausalLM` (`num_nextn_predict_layers`: the
    model's multi-token-prediction depths, which transformers does not compute)."""
    problems = _export_problems(args)
    if problems:
        raise ModelConfigError(
            f"model: DeepseekV3ForCausalLM cannot compute this model: {'; '.join(problems)}"
        )
    if not math.isclose(_latent_eps(args), HF_LATENT_NORM_EPS):
        logger.warning(
            "model: latent_norm_eps %g differs from DeepseekV3ForCausalLM's fixed %g; exported logits differ slightly",
            _latent_eps(args),
            HF_LATENT_NORM_EPS,
        )
    if args.final_norm_eps is None or not math.isclose(args.final_norm_eps, args.norm_eps):
        logger.warning(
            "model: final_norm_eps %s differs from rms_norm_eps %g, which DeepseekV3ForCausalLM's final norm "
            "uses; exported logits differ slightly",
            args.final_norm_eps,
            args.norm_eps,
        )
    return shared.add_token_ids(_describe(args), args, bos_id, eos_id, dtype)


def _import_problems(config: dict[str, Any]) -> list[str]:
    get = lambda key: config.get(key, _DEFAULTS.get(key))  # noqa: E731
    problems = shared.basic_problems(get, MODEL_TYPES, "MLA")
    architectures = config.get("architectures") or [_ARCHITECTURE]
    if architectures != [_ARCHITECTURE]:
        problems.append(f"architectures {architectures} (Titan reads {_ARCHITECTURE}'s weights only)")
    if not get("rope_interleave"):
        problems.append("rope_interleave false (Titan rotates interleaved pairs)")
    if get("tie_word_embeddings"):
        problems.append("tie_word_embeddings true (DeepSeek-V3 keeps them apart)")
    _, scaling = shared.rope_from_config(config)
    if scaling is not None:
        if scaling["rope_type"] != "yarn":
            problems.append(f"rope_scaling.rope_type '{scaling['rope_type']}' (Titan implements 'yarn' only)")
        elif not scaling.get("mscale_all_dim") or scaling.get("mscale") not in (
            None,
            scaling["mscale_all_dim"],
        ):
            problems.append(
                "rope_scaling.mscale must equal mscale_all_dim (else Hugging Face scales cos/sin, which Titan does not)"
            )
        elif scaling.get("attention_factor") not in (None, 1, 1.0):
            problems.append(f"rope_scaling.attention_factor {scaling['attention_factor']} (Titan's is 1)")
    return problems + shared.missing_keys(config, _REQUIRED)


def args_from_hf_config(config: dict[str, Any], **overrides: Any) -> DeepSeekV3Args:
    """The DeepSeekV3Args of the model a `DeepseekV3ForCausalLM` config.json describes (refusing what Titan
    cannot compute). Its multi-token-prediction layers (`num_nextn_predict_layers`) are trained only when
    the run asks (`num_mtp_layers` in `overrides`)."""
    shared.refuse_unsupported(_import_problems(config))
    get = lambda key: config.get(key, _DEFAULTS.get(key))  # noqa: E731
    groups, limited = get("n_group"), get("topk_group")
    if groups in (None, 1):  # one group holding every expert: plain top-k
        groups = limited = None
    context = int(get("max_position_embeddings"))
    theta, scaling = shared.rope_from_config(config)
    rope: dict[str, Any] = {"yarn": False, "rope_theta": theta}
    if scaling is not None:
        original = int(scaling["original_max_position_embeddings"])
        factor = scaling.get("factor") or context / original
        rope = dict(
            yarn=True,
            rope_theta=theta,
            rope_factor=float(factor),
            original_seq_len=original,
            beta_fast=scaling.get("beta_fast") or 32,
            beta_slow=scaling.get("beta_slow") or 1,
            mscale=float(scaling["mscale_all_dim"]),
        )
    moe = MoEArgs(
        num_experts=config["n_routed_experts"],
        num_shared_experts=get("n_shared_experts"),
        score_func="sigmoid",
        route_norm=bool(get("norm_topk_prob")),
        route_scale=float(get("routed_scaling_factor")),
        score_before_experts=False,
        top_k=config["num_experts_per_tok"],
        num_expert_groups=groups,
        num_limited_groups=limited,
    )
    args = dict(
        dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_dense_layers=min(get("first_k_dense_replace"), config["num_hidden_layers"]),
        n_heads=config["num_attention_heads"],
        vocab_size=config["vocab_size"],
        inter_dim=config["intermediate_size"],
        moe_inter_dim=config["moe_intermediate_size"],
        norm_eps=float(get("rms_norm_eps")),
        latent_norm_eps=HF_LATENT_NORM_EPS,
        final_norm_eps=float(get("rms_norm_eps")),
        moe_args=moe,
        q_lora_rank=get("q_lora_rank") or 0,
        kv_lora_rank=config["kv_lora_rank"],
        qk_nope_head_dim=config["qk_nope_head_dim"],
        qk_rope_head_dim=config["qk_rope_head_dim"],
        v_head_dim=config["v_head_dim"],
        max_seq_len=min(context, 2048),
        context_len=context,
        **rope,
    )
    return DeepSeekV3Args(**{**args, **overrides})


def _computed_fields(args: DeepSeekV3Args) -> dict[str, Any]:
    """The fields that change the function computed, named as config.json names them."""
    fields = _describe(args)
    # The MTP depths add a training loss; the main model's function is the same without them.
    for key in ("architectures", "model_type", "max_position_embeddings", "num_nextn_predict_layers"):
        fields.pop(key)
    scaling = fields.pop("rope_scaling")
    fields["rope_scaling"] = None if scaling is None else "yarn"
    for key, value in (scaling or {}).items():
        fields[f"rope_scaling.{key}"] = value
    m = args.moe_args
    fields |= {
        "score_func": m.score_func,
        "score_before_experts": m.score_before_experts,
        "gate_bias": m.gate_bias,
    }
    fields["latent_norm_eps"] = _latent_eps(args)
    return fields


hf_config_differences = shared.differences_checker(
    unsupported=_import_problems, args_from_config=args_from_hf_config, computed_fields=_computed_fields
)
