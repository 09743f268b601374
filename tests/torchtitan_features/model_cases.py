"""torchtitan 0.2.2's integration model cases (the mixture-of-experts families), as data.

Transcribed from `tests/integration_tests/models.py` of pytorch/torchtitan at tag v0.2.2 (commit
73a0e697), in the form of `cases.py`: name, description, the flags of each run, process count.
torchtitan's runner launches them on the same base config as the feature cases (`run_tests.py
--test_suite models`, default `--config_path`), so the flavor is the base config's `debugmodel`
unless a case names another; here they get the same CPU cut (`cases.CUT`).

`pp_dualpipev` keeps 4 sequences per rank, not 2: torch's DualPipeV schedule needs at least one
microbatch per stage (2 pipeline ranks hold 4 stages).
"""

from __future__ import annotations

from torchtitan_features.cases import PP, SCHEDULE, Case, _case

EP = "--parallelism.expert_parallel_degree"
ETP = "--parallelism.expert_tensor_parallel_degree"
DP_SHARD = "--parallelism.data_parallel_shard_degree"
TP = "--parallelism.tensor_parallel_degree"

MODEL_CASES: list[Case] = [
    _case(
        "deepseek_v3_fsdp+ep+compile",
        "DeepSeek V3 FSDP+EP+compile",
        ["--model.name deepseek_v3", f"{DP_SHARD} 4", f"{EP} 2", "--compile.enable"],
        ngpu=4,
    ),
    _case(
        "pp_dualpipev",
        "PP dual pipe v schedule test",
        [
            "--model.name deepseek_v3",
            f"{PP} 2",
            f"{EP} 2",
            f"{SCHEDULE} DualPipeV",
            "--activation_checkpoint.mode 'none'",
        ],
        ngpu=4,
    ),
    _case(
        "deepseek_v3_pp+fsdp+tp+ep",
        "DeepSeek V3 PP+FSDP+TP+EP",
        [
            "--model.name deepseek_v3",
            f"{PP} 2",
            f"{SCHEDULE} Interleaved1F1B",
            f"{DP_SHARD} 2",
            f"{TP} 2",
            f"{EP} 4",
            f"{ETP} 1",
        ],
        ngpu=8,
    ),
    _case(
        "deepseek_v3_pp+fsdp+tp+ep+etp",
        "DeepSeek V3 PP+FSDP+TP+EP+ETP",
        [
            "--model.name deepseek_v3",
            f"{PP} 2",
            f"{SCHEDULE} Interleaved1F1B",
            f"{DP_SHARD} 2",
            f"{TP} 2",
            f"{EP} 2",
            f"{ETP} 2",
        ],
        ngpu=8,
    ),
    _case(
        "deepseek_v3_flex+pp+fsdp+ep+sacop",
        "DeepSeek V3 Flex+PP+FSDP+EP+SACOP",
        [
            "--model.name deepseek_v3",
            "--model.flavor debugmodel_flex_attn",
            f"{DP_SHARD} 4",
            f"{PP} 2",
            f"{SCHEDULE} Interleaved1F1B",
            f"{EP} 4",
            "--activation_checkpoint.mode 'selective'",
            "--activation_checkpoint.selective_ac_option 'op'",
        ],
        ngpu=8,
    ),
    _case("qwen3_fsdp+tp", "Qwen3 FSDP+TP", ["--model.name qwen3", f"{DP_SHARD} 2", f"{TP} 2"], ngpu=4),
    _case(
        "qwen3_fsdp+tp+ep+etp",
        "Qwen3 FSDP+TP+EP+ETP",
        [
            "--model.name qwen3",
            "--model.flavor debugmodel_moe",
            f"{DP_SHARD} 2",
            f"{TP} 2",
            f"{EP} 2",
            f"{ETP} 2",
        ],
        ngpu=4,
    ),
    _case(
        "llama4_pp+fsdp+tp+ep+compile",
        "Llama 4 PP+FSDP+TP+EP+compile",
        [
            "--model.name llama4",
            f"{PP} 2",
            f"{SCHEDULE} Interleaved1F1B",
            f"{DP_SHARD} 2",
            f"{TP} 2",
            f"{EP} 4",
            f"{ETP} 1",
            "--compile.enable",
        ],
        ngpu=8,
    ),
    _case(
        "gpt_oss_fsdp+tp+ep+compile",
        "Gpt-oss FSDP+TP+EP+compile",
        ["--model.name gpt_oss", f"{DP_SHARD} 4", f"{TP} 2", f"{EP} 4", f"{ETP} 1", "--compile.enable"],
        ngpu=8,
    ),
]
NOT_APPLICABLE: dict[str, str] = {}
MODEL_ENABLED = [case for case in MODEL_CASES if case.name not in NOT_APPLICABLE]
