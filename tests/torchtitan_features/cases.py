"""torchtitan 0.2.2's integration feature cases, as data.

Transcribed from `tests/integration_tests/features.py` of pytorch/torchtitan at tag v0.2.2 (commit
73a0e697): for each case, its name, the flags of each of its sequential runs (one dump folder per
case), its process count (torchtitan's default is 4) and whether torchtitan disables it. The flags
are torchtitan's, unchanged, as its runner joins them into a shell command line. Two values come
from torchtitan's CI environment and are filled in when run: `{output_dir}` (its runner's output
folder, where `model_only_hf_checkpoint` finds the first run's Hugging Face export) and the second
run of `test_generate`, which is torchtitan's generation script, not a training run (GENERATE): the
tests run `titan-train generate` in its place, on the checkpoint the first run wrote.

The base config is `base_config.toml` beside this file. CUT shrinks it for CPU: sequences of 64
tokens, 2 per data-parallel rank, Titan's bundled tokenizer. `pp_custom_csv` keeps torchtitan's 8
sequences per rank: its CSV schedule (tests/assets/custom_schedule.csv, also torchtitan's) runs 8
microbatches. It and `gradient_accumulation` (8 sequences per rank, accumulated to 32) train 4 steps.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent
REPO = HERE.parents[1]
BASE_CONFIG = HERE / "base_config.toml"
TOKENIZER = REPO / "packages" / "titan-data" / "src" / "titan_data" / "assets" / "tokenizer"
GENERATE = "generation script"
CUT = (
    "--training.seq_len 64",
    "--training.local_batch_size 2",
    "--validation.seq_len 64",
    "--validation.local_batch_size 2",
    f"--model.hf_assets_path {TOKENIZER}",
)
CASE_CUT = {
    # The two cases of 8-sequence batches, the longest of CI's 2-process cases, train 4 of the base config's
    # 10 steps: every step runs the same schedule or accumulation, so steps 5 to 10 showed nothing new.
    "pp_custom_csv": ("--training.local_batch_size 8", "--training.steps 4"),
    "gradient_accumulation": ("--training.steps 4",),
    # model_cases.py: DualPipeV runs at least one microbatch per stage (4 stages on 2 pipeline ranks).
    "pp_dualpipev": ("--training.local_batch_size 4",),
}


@dataclass(frozen=True)
class Case:
    name: str
    description: str
    runs: tuple[tuple[str, ...] | str, ...]
    ngpu: int = 4
    disabled: bool = False

    def argv(self, run: int, output_dir: Path) -> list[str]:
        """The command-line overrides of run `run`, as torchtitan's runner passes them to run_train.sh
        (after the dump folder), preceded by the CPU cut."""
        flags = (*CUT, *CASE_CUT.get(self.name, ()), *self.runs[run])
        words = shlex.split(" ".join(flags).format(output_dir=output_dir))
        return ["--job.dump_folder", str(output_dir / self.name), *words]


def _case(name, description, *runs, ngpu=4, disabled=False) -> Case:
    return Case(
        name, description, tuple(tuple(r) if not isinstance(r, str) else r for r in runs), ngpu, disabled
    )


PP = "--parallelism.pipeline_parallel_degree"
SCHEDULE = "--parallelism.pipeline_parallel_schedule"
HF_CHECKPOINT = "{output_dir}/model_only_hf_checkpoint/hf_checkpoint/step-10/"

CASES = [
    _case("default", "default", ["--profiling.enable_profiling", "--metrics.enable_tensorboard"]),
    _case("1d_compile", "1D compile", ["--compile.enable"]),
    _case(
        "1d_compile_sac_op",
        "1D compile with selective op AC",
        [
            "--compile.enable",
            "--activation_checkpoint.mode selective",
            "--activation_checkpoint.selective_ac_option op",
        ],
    ),
    _case("2d_eager", "2D eager", ["--parallelism.tensor_parallel_degree 2"]),
    _case("2d_compile", "2D compile", ["--compile.enable", "--parallelism.tensor_parallel_degree 2"]),
    _case(
        "2d_asynctp_compile",
        "2D async TP compile",
        [
            "--compile.enable",
            "--parallelism.tensor_parallel_degree 2",
            "--parallelism.enable_async_tensor_parallel",
        ],
        disabled=True,
    ),
    _case(
        "full_checkpoint",
        "Checkpoint Integration Test - Save Load Full Checkpoint",
        ["--checkpoint.enable"],
        ["--checkpoint.enable", "--training.steps 20"],
    ),
    _case(
        "model_only_hf_checkpoint",
        "Checkpoint Integration Test - save load model only checkpoint in HF definition and format",
        [
            "--checkpoint.enable",
            "--checkpoint.folder hf_checkpoint",
            "--checkpoint.last_save_model_only",
            "--checkpoint.last_save_in_hf",
        ],
        [
            "--checkpoint.enable",
            f"--checkpoint.initial_load_path {HF_CHECKPOINT}",
            "--checkpoint.initial_load_model_only",
            "--checkpoint.initial_load_in_hf",
        ],
    ),
    _case(
        "last_save_model_only_fp32",
        "Checkpoint Integration Test - Save Model Only fp32",
        ["--checkpoint.enable", "--checkpoint.last_save_model_only"],
    ),
    _case(
        "last_save_model_only_bf16",
        "Checkpoint Integration Test - Save Model Only bf16",
        ["--checkpoint.enable", "--checkpoint.last_save_model_only", "--checkpoint.export_dtype bfloat16"],
    ),
    _case(
        "pp_looped_zero_bubble",
        "PP looped zero bubble test",
        [f"{PP} 4", f"{SCHEDULE} InterleavedZeroBubble"],
        ngpu=4,
    ),
    _case("pp_zbv", "PP zero bubble test (v shaped)", [f"{PP} 2", f"{SCHEDULE} ZBVZeroBubble"], ngpu=2),
    _case(
        "pp_1f1b",
        "PP 1D test 1F1B",
        [f"{PP} 2", f"{SCHEDULE} 1F1B", "--parallelism.data_parallel_shard_degree 1"],
        ngpu=2,
    ),
    _case(
        "pp_gpipe",
        "PP 1D test GPipe",
        [f"{PP} 2", f"{SCHEDULE} GPipe", "--parallelism.data_parallel_shard_degree 1"],
        ngpu=2,
    ),
    _case(
        "pp_dp_1f1b",
        "PP+DP 1F1B 2D test",
        [f"{PP} 2", f"{SCHEDULE} 1F1B", "--parallelism.data_parallel_shard_degree 2"],
        [
            f"{PP} 2",
            f"{SCHEDULE} 1F1B",
            "--parallelism.pipeline_parallel_layers_per_stage 4",
            "--parallelism.data_parallel_shard_degree 2",
        ],
    ),
    _case(
        "pp_dp_gpipe",
        "PP+DP GPipe 2D test",
        [f"{PP} 2", f"{SCHEDULE} GPipe", "--parallelism.data_parallel_shard_degree 2"],
    ),
    _case("pp_tp", "PP+TP 2D test", [f"{PP} 2", "--parallelism.tensor_parallel_degree 2"]),
    _case(
        "pp_dp_tp",
        "PP+DP+TP 3D test with save/load resume ckpt",
        [
            "--checkpoint.enable",
            f"{PP} 2",
            "--parallelism.data_parallel_shard_degree 2",
            "--parallelism.tensor_parallel_degree 2",
        ],
        [
            "--training.steps 20",
            "--checkpoint.enable",
            f"{PP} 2",
            "--parallelism.data_parallel_shard_degree 2",
            "--parallelism.tensor_parallel_degree 2",
        ],
        ngpu=8,
    ),
    _case(
        "3d_compile",
        "PP+DP+TP 3D test with torch.compile",
        [
            f"{PP} 2",
            "--parallelism.data_parallel_shard_degree 2",
            "--parallelism.tensor_parallel_degree 2",
            "--compile.enable",
        ],
        ngpu=8,
    ),
    _case(
        "pp_looped_1f1b",
        "PP looped 1F1B test",
        [f"{PP} 4", f"{SCHEDULE} Interleaved1F1B"],
        [f"{PP} 4", f"{SCHEDULE} Interleaved1F1B", "--parallelism.pipeline_parallel_layers_per_stage 1"],
        ngpu=4,
    ),
    _case(
        "pp_custom_csv",
        "PP with custom pipeline schedule loaded from CSV file",
        [
            f"{PP} 2",
            f"{SCHEDULE} PipelineScheduleMulti",
            "--parallelism.pipeline_parallel_schedule_csv ./tests/assets/custom_schedule.csv",
        ],
        ngpu=2,
    ),
    _case(
        "optimizer_foreach",
        "Foreach Optimizer Test",
        ["--optimizer.name AdamW --optimizer.implementation foreach"],
        ngpu=2,
    ),
    _case(
        "ddp",
        "DDP",
        ["--parallelism.data_parallel_shard_degree=1", "--parallelism.data_parallel_replicate_degree=4"],
        ngpu=4,
    ),
    _case(
        "hsdp",
        "HSDP",
        ["--parallelism.data_parallel_shard_degree=2", "--parallelism.data_parallel_replicate_degree=2"],
        ngpu=4,
    ),
    _case(
        "fsdp+flex_attn",
        "FSDP+FLEX_ATTN",
        [
            "--parallelism.data_parallel_shard_degree=4",
            "--activation_checkpoint.mode='full'",
            "--model.flavor=debugmodel_flex_attn",
        ],
        ngpu=4,
    ),
    _case(
        "fsdp+flex_attn+per_op_sac",
        "FSDP + FLEX + per op SAC",
        [
            "--parallelism.data_parallel_shard_degree=4",
            "--activation_checkpoint.mode=selective",
            "--activation_checkpoint.selective_ac_option=op",
            "--model.flavor=debugmodel_flex_attn",
        ],
        ngpu=4,
    ),
    _case(
        "fsdp+varlen_attn+per_op_sac",
        "FSDP+VARLEN_ATTN + per op SAC",
        [
            "--parallelism.data_parallel_shard_degree=4",
            "--activation_checkpoint.mode=selective",
            "--activation_checkpoint.selective_ac_option=op",
            "--model.flavor=debugmodel_varlen_attn",
        ],
        ngpu=4,
    ),
    _case(
        "cp_allgather",
        "CP (allgather)",
        [
            "--parallelism.context_parallel_degree=4",
            "--parallelism.context_parallel_rotate_method='allgather'",
        ],
        ngpu=4,
    ),
    _case(
        "cp_alltoall",
        "CP (alltoall)",
        [
            "--parallelism.context_parallel_degree=4",
            "--parallelism.context_parallel_rotate_method='alltoall'",
        ],
        ngpu=4,
    ),
    _case(
        "hsdp+tp",
        "HSDP+TP",
        [
            "--parallelism.data_parallel_shard_degree=2",
            "--parallelism.data_parallel_replicate_degree=2",
            "--parallelism.tensor_parallel_degree=2",
        ],
        ngpu=8,
    ),
    _case(
        "fsdp+cp",
        "FSDP+CP",
        ["--parallelism.data_parallel_shard_degree=2", "--parallelism.context_parallel_degree=2"],
        ngpu=4,
    ),
    _case(
        "hsdp+cp_without_dp_shard",
        "HSDP+CP (without dp_shard)",
        [
            "--parallelism.data_parallel_shard_degree=1",
            "--parallelism.data_parallel_replicate_degree=2",
            "--parallelism.context_parallel_degree=2",
        ],
        ngpu=4,
    ),
    _case(
        "hsdp+cp_with_dp_shard",
        "HSDP+CP (with dp_shard)",
        [
            "--parallelism.data_parallel_shard_degree=2",
            "--parallelism.data_parallel_replicate_degree=2",
            "--parallelism.context_parallel_degree=2",
        ],
        ngpu=8,
    ),
    _case(
        "fsdp+tp+cp",
        "FSDP+TP+CP",
        [
            "--parallelism.data_parallel_shard_degree=2",
            "--parallelism.tensor_parallel_degree=2",
            "--parallelism.context_parallel_degree=2",
        ],
        ngpu=8,
    ),
    _case(
        "cpu_offload+opt_in_bwd+TP+DP+CP",
        "Enable CPU Offload, Optimizer in backward with TP, DP, CP",
        [
            "--checkpoint.enable",
            "--parallelism.tensor_parallel_degree=2",
            "--parallelism.context_parallel_degree=2",
            "--training.enable_cpu_offload",
            "--optimizer.early_step_in_backward",
        ],
        [
            "--parallelism.tensor_parallel_degree=2",
            "--parallelism.context_parallel_degree=2",
            "--parallelism.data_parallel_replicate_degree=2",
            "--training.enable_cpu_offload",
            "--optimizer.early_step_in_backward",
        ],
        ngpu=8,
    ),
    _case(
        "fsdp2_memory_estimation",
        "FSDP2 Memory Tracking and Estimation",
        ["--memory_estimation.enable"],
        ngpu=2,
        disabled=True,
    ),
    _case("test_generate", "Generation script test", ["--checkpoint.enable"], GENERATE, ngpu=2),
    _case(
        "fsdp_reshard_always",
        "Test always resharding after forward pass",
        ["--parallelism.fsdp_reshard_after_forward always"],
        ngpu=2,
    ),
    _case(
        "optional_checkpoint",
        "Optional checkpoint",
        ["--checkpoint.enable", "--training.steps 10"],
        [
            "--checkpoint.enable",
            "--checkpoint.exclude_from_loading lr_scheduler,dataloader,optimizer",
            "--parallelism.tensor_parallel_degree 2",
            "--training.steps 20",
        ],
    ),
    _case(
        "float8_emulation",
        "Float8 emulation test",
        [
            "--model.converters quantize.linear.float8",
            "--quantize.linear.float8.enable_fsdp_float8_all_gather",
            "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
            "--quantize.linear.float8.emulate",
        ],
    ),
    _case(
        "gradient_accumulation",
        "Gradient accumulation",
        ["--training.local_batch_size 8", "--training.global_batch_size 32"],
        ngpu=2,
    ),
    _case(
        "validation_tp_cp_pp",
        "Validation test with tp, cp, pp",
        [
            "--validation.enable",
            "--validation.dataset c4_test",
            "--parallelism.tensor_parallel_degree=2",
            "--parallelism.context_parallel_degree=2",
            "--parallelism.pipeline_parallel_degree=2",
            f"{SCHEDULE} Interleaved1F1B",
        ],
        ngpu=8,
    ),
    _case(
        "dataloader_kwargs",
        "Dataloader kwargs (via CLI args)",
        [
            "--training.dataloader.num_workers",
            "2",
            "--training.dataloader.pin_memory",
            "--training.dataloader.persistent_workers",
            "--training.dataloader.prefetch_factor",
            "4",
        ],
        ngpu=2,
    ),
]
ENABLED = [case for case in CASES if not case.disabled and case.ngpu <= 8]
