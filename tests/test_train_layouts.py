"""Every layout titan-train offers trains the run of one process, through the trainer itself.

Each torchrun launch (1, 2 or 4 ranks, real gloo groups; one per world size, see LAUNCH) runs titan-train's
Trainer once per layout in the same processes (tests/workers/layout_matrix.py): the debug model cut to 2
layers (4 for schedules with two stages per pipeline rank), seq 64, a global batch of 4 sequences
dealt from 4 streams so that the data does not depend on the layout, 5 steps. Each layout is
compared with one process on the same global batch, step by step, by loss and by grad_norm (the norm
before clipping: AdamW and clipping hide a uniformly wrong gradient scale from the losses and, Adam
being scale-invariant, from the weights), and by its final weights where the arithmetic is the same
up to rounding.

Loader worker processes keep exact resume: `fsdp_loader_workers` (torchtitan's dataloader_kwargs
settings) and a 1-rank run with 2 workers taking 6 windows a step from 8 streams save at step 3, and
2-rank runs resume from both saves (`checkpoint.load_step`). Steps 4 and 5 and the final weights must
be those of the run resumed: bit for bit from 2 ranks, to the layouts' tolerance from 1 rank.

Expert parallelism: a qwen3 mixture-of-experts model cut to dim 64 (2 layers of 8 experts, top 2, its own
one-process reference `one_process_moe`) trains under tp alone, ep 2, ep 2 with FSDP (4 ranks), ep 4
borrowing tp, ep 2 with etp = tp = 2, ep 2 with cp 2, ep 2 with pp 2 and ep 2 under per-op selective
checkpointing (its logged token counts one process's: a recomputed MoE forward does not count again), each taking the layout's expert mesh and
placements as facts; the ep 2 run on 4 ranks saves at step 3 and runs at ep 1 on 2 ranks and at ep 4 on 4 ranks resume it. A
gradient scaled by 1.5 in the experts' dispatch (input rows) or combine (output rows) made `moe_ep2` fail
(weights 7e-3 off; grad_norm 8e-5 relative). The MoE layouts add about 62 CPU-seconds (load 9 on 2 cores).
Shared experts: a DeepSeek-V3 layer cut the same way with one shared expert and the sequence-wise aux loss on
(`deepseek_v3 tiny_shared`, reference `one_process_shared`) trains under tp 2, ep 2 borrowing tp 2, and pp 2
(32 s in the 2-rank launch and 4 s in the 1-rank one, loaded machine).
Multi-token prediction: the same cut with one MTP depth (`--model.num_mtp_layers 1`, reference `one_process_mtp`)
under FSDP 2 and EP 2: loss and mtp_loss within 1.2e-7 relative, grad_norm 8.7e-8, expert counts equal, weights
within 5.4e-7 (2026-11-28; about 4 s a row); under TP 2 (the depth's block, norms and projection split, its
logits vocabulary-sharded): loss equal, mtp_loss 1.2e-7, grad_norm 9.6e-8, weights 1.4e-6; under PP 2 (1F1B, the
depth on the last stage fed the embeddings the first stage carries): loss 1.1e-7, mtp_loss 1.2e-7, grad_norm
equal, weights 3.4e-7 (2026-11-28). Depth k reading the embeddings k + 1 places ahead under PP failed mtp_pp
(loss 4.4e-3 relative off), the carried embeddings detached (no MTP gradient into the embedding) failed it too
(grad_norm 3.0e-5); under TP, the depth rolling its rank's sequence shard of the embeddings (not re-embedding
the rolled tokens) failed mtp_tp (loss 1.7e-4); the step's first MTP loss kept from torch's metadata inference put mtp_pp's step-1 mtp_loss 1% off.

LoRA (all-linear, rank 4, the base frozen) under FSDP 2, PP 2 (1F1B) and compile against LoRA in one process:
loss within 2.4e-7 relative, grad_norm 6.3e-8, weights 2.2e-6 (2026-11-27); under TP 2 (adapters split beside
their layers): loss 1.2e-7, grad_norm 1.2e-7. LoRA under CP 2, and on the qwen3 MoE cut under EP 2 against
that model's LoRA in one process; over a float8 (tensorwise) base against LoRA over float32 within float8's
rounding (LORA_FLOAT8_REL). A 1% adapter scale on sequence shards failed lora_cp2, experts left trainable
under EP failed lora_moe_ep2.
QLoRA (the adapted layers' frozen base in NF4) under FSDP 2 and HSDP (2 x 2) against QLoRA in one process:
loss within 1.5e-7 relative, grad_norm 6e-8, weights 1.1e-5 (2026-11-27), 4.9e-5 in a later run (the
bound is QLORA_WEIGHTS_ATOL); each rank quantising only its own
shard failed qlora_fsdp (grad_norm 1.6e-4 off, adapters 5.7e-3).

Chat rows (the bundled conversations packed into rows of 128, loss on assistant turns) under FSDP 2, FSDP 2
with 2 accumulated micro-batches, TP 2 and PP 2 (1F1B) against one process: loss within 3.3e-7 relative,
grad_norm 1.6e-7, weights 2.9e-5 (2026-11-27); without weighting each micro-batch by its trained tokens,
FSDP's loss was 1.2% off and PP's grad_norm 5.6%. Under CP 2 (`chat_cp2`, head-tail; `chat_cp2_ptrr`) each row is
dealt to the ranks with its conversations' documents and every rank attends over the gathered keys: loss within
4e-7 relative, grad_norm 3e-7 (2026-12-02); without the context-parallel ranks in the token weights' shares the
loss was half. Block-causal text under CP 2 (`block_causal_cp2`, `block_causal_cp2_ptrr` against
`one_process_block_causal`) and causal text dealt by ptrr (`cp_ptrr`) likewise: 1.2e-7; the gathered mask
without its document term put `block_causal_cp2`'s losses 5.5e-5 relative off (those of plain causal attention).

Preference pairs (DPO, sigmoid, a frozen reference built and sharded like the policy; the bundled pairs packed
into rows of 128) under FSDP 2 and FSDP 2 with 2 accumulated micro-batches against one process: loss within
4.2e-7 relative, grad_norm 4.0e-7, weights 2.8e-6 (2026-11-28); under TP 2 with the logits sharded over the
vocabulary (loss parallelism): loss 5.4e-7, grad_norm 4.6e-7, weights 1.7e-5; on the qwen3 MoE cut under EP 2 against
that cut in one process (`one_process_dpo_moe`): loss 2.0e-7, grad_norm 1.1e-7, weights 3.9e-7, and the same with
the reference precomputed (2026-11-28); that pass run in training mode counted its routing into step 1's tokens
per expert and failed dpo_moe_ep2_precompute. Under PP 2 (1F1B; the pair loss on the last stage, per microbatch,
the frozen copy's log-probs from its own forward-only pipeline pass): loss within 5.2e-7 relative, grad_norm
4.6e-7, weights 2.8e-6 (`dpo_pp`); precomputed through the policy's pipeline, on windows of 160 that hold 1 or 2
pairs (`dpo_pp_precompute` against `one_process_dpo_uneven`): loss within 1.2e-7 relative, grad_norm 3.2e-7, weights 1.8e-6; compiled in one process (`dpo_compile`):
loss 5.2e-7, grad_norm 4.6e-7, weights 5.5e-6 (2026-11-28). Every preference row also compares TRL's six reward
and log-prob metrics at every step, relative to the value or to 1 below it: within 8.9e-7 (compile; 6.6e-7 TP,
6.4e-7 PP). The frozen copy's sums left out of the last stage's target failed dpo_pp (step 1's loss 2.21, not
0.693); each microbatch's pairs averaged instead of the step's failed dpo_pp_precompute (loss 16% off), which
128-token windows, one pair each, cannot show. ORPO under PP 2 on the 160-token windows (`orpo_pp` against
`one_process_orpo`): loss 8.7e-8, grad_norm equal, weights 9.5e-7. Under CP 2 (`dpo_cp2`, `dpo_cp2_ptrr`, `orpo_cp2`;
windows dealt per row, per-sequence sums added over the group): loss and grad_norm equal to 1e-6 (2026-12-02); the
sums carrying no gradient back across the group halved dpo_cp2's grad_norm.

GRPO (issue 59; dapo, beta 0.05, rewards scaled over the batch) on rollouts the test draws and the rows replay
(`write_grpo_rollouts`; the `*_generating` rows generate), each against the same run in one process: FSDP 2 (`grpo_fsdp2`),
TP 2 with the log-probs and entropies taken from the vocabulary-sharded logits (`grpo_tp2`), EP 2 on the qwen3 MoE
cut (`grpo_ep2`, its own one process; expert counts equal), LoRA and QLoRA under FSDP 2 (`grpo_lora`,
`grpo_qlora`, the KL reference the base with adapters off): loss within 1.5e-7 relative, grad_norm 8e-8, reward,
reward_std, kl and entropy 1.2e-7 (of the value, or of 1 below it), weights 5.9e-6 (TP; 1e-6 for the rest)
(2026-12-02). Advantages from each rank's own rewards (not gathered over the data-parallel ranks before the
batch's std) put grpo_fsdp2's step-1 loss 22% off (-0.141 against -0.182); dapo dividing by the rank's own
completion tokens (no all-reduce) put grpo_fsdp2's and grpo_ep2's at -0.045. The titan engine generating
(sampled at temperature 1; every rank decodes on an unparallelised copy of the gathered weights, each completion
seeded by its prompt's index) under TP 2 (`grpo_tp2_generating`, against `one_process_grpo_generating`) and EP 2
on the qwen3 MoE cut (`grpo_ep2_generating`, each rank its own prompts, against `one_process_grpo_moe_generating`):
rewards equal, loss within 1.1e-8 absolute (a cancellation near 0: GENERATING), grad_norm and entropy 1.4e-7
relative, weights 3.3e-6, expert counts equal (2026-12-03); the tp ranks seeding apart failed grpo_tp2_generating
(their completions checked equal), seeds of a rank's own prompt positions failed grpo_ep2_generating. Pipeline
parallelism is refused at start (`grpo_pp`: the step scores tokens on one whole model part), as is context
parallelism (`grpo_cp2`). The GRPO rows cost about 9.5 CPU-seconds on rank 0 (17 to 35 s of wall time in the
launches they join, loaded machine; 2026-12-02), the four generating ones about 7.4 more (2026-12-03).

Muon (`optimizer.name = "Muon"`) under FSDP 2, TP 2, PP 2 (1F1B), HSDP (2 x 2), FSDP 2 x TP 2 and, on the qwen3 MoE cut,
EP 2 and EP 2 x ETP 2 (= TP 2; each expert's matrix split, gathered whole), against Muon in one process, with
Newton-Schulz in float32 (`optimizer.muon.ns_dtype`): loss and grad_norm within EXACT, weights within WEIGHTS_ATOL,
as every exact row (2026-11-28, second session). In bfloat16 (torch.optim.Muon's, the default) gradients that differ
by float noise round differently, and the weights only agreed to 7.0e-4 of their norm; bfloat16 matmuls are also
29x slower on this CPU. Saved under FSDP 2 at step 3 and resumed under FSDP 2 x TP 2: the losses of steps 4 and 5
equal to the bit.

Qwen3.5, its debug models cut to a gated full-attention block then a Gated DeltaNet block (`one_process_qwen3_5`),
under FSDP 2, TP 2 (both kinds of layer split by head), PP 2 (1F1B), CP 2 (the linear layer gathering the whole
sequence) and, on its MoE cut, EP 2; on packed documents (block-causal, the linear layer restarting at each;
`one_process_qwen3_5_packed`) under FSDP 2, TP 2, PP 2, full activation checkpointing and compile: loss within
2.4e-7 relative, grad_norm 1.1e-7, weights 4.0e-5 (the decay path, QWEN3_5_WEIGHTS_ATOL; 2026-12-02). Every rank
taking the first heads' A_log and dt_bias under TP put qwen3_5_tp's step-1 loss 2.0e-4 relative off; each rank
running the linear layer over its own sequence shard under CP put qwen3_5_cp2's 4.4e-5 off. The qwen3_5 rows but
the compiled one cost about 11 CPU-seconds on rank 0 (18 s of wall time, quiet machine); the compiled one 19 more
with a cold inductor cache (142 s of wall time while the suite ran beside it; 6 s warm and quiet).

Measured on a 2-core CPU with torch 2.15 (float32): every exact layout within 2.4e-7 relative of one
process on loss and grad_norm at every step, weights within 4.8e-6 (compile; 4.2e-6 for CP + FSDP);
float8 drifts up to 7.8e-5 (loss, rowwise) and 1.8e-4 (grad_norm, tensorwise).
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from titan_train.objectives.preference_step import (
    METRICS as PREFERENCE_METRICS,  # TRL's rewards/* and logps/*
)
from titan_train.torchrun import run_torchrun

# A launch runs inside the first test that reads one of its rows, after the launches whose saves it resumes.
pytestmark = pytest.mark.timeout(2400)

WORKER = Path(__file__).parent / "workers" / "layout_matrix.py"
DEBUG_CONFIG = Path(__file__).parents[1] / "apps" / "configs" / "debug_model.toml"
STEPS = 5
BASE = (
    "--job.config_file",
    str(DEBUG_CONFIG),
    "--metrics.disable_color_printing",
    "--metrics.log_freq",
    "1",
    "--metrics.enable_tensorboard",
    "false",
    "--training.steps",
    str(STEPS),
    "--training.seq_len",
    "64",
    "--training.dataloader.num_streams",
    "4",
    "--model.flavor",
    "debug_2_layers",
    "--training.local_batch_size",
    "4",
)
FOUR_LAYERS = ("--model.flavor", "debug_4_layers")

EXACT = 1e-5  # relative, loss and grad_norm at every step; 40x the largest difference measured
WEIGHTS_ATOL = 2e-5  # one element's Adam update is ~1e-3: any update that went another way shows
FLOAT8_REL = 5e-4  # relative, loss and grad_norm; 2.8x the largest drift measured
# float8 layouts against float8 in one process, by the distance of each weight from the reference's, over the
# reference's norm: Adam turns float8 rounding noise on near-zero gradients into whole +-lr updates, so single
# elements differ by up to 9e-3 while the tensors stay close (measured at most 9.0e-3 under TP (tensorwise),
# 1.0e-2 (rowwise), 4.3e-2 under FSDP + TP with float8 all-gathers, 3.3e-3 for emulated MXFP8 under FSDP);
# float8 loss and grad_norm under TP: at most 5.5e-5 from one process.
FLOAT8_WEIGHTS_REL = 0.1
FLOAT8_TENSORWISE_RUN = {
    "reference": "float8_tensorwise",
    "rel": FLOAT8_REL,
    "weights_atol": None,
    "weights_rel": FLOAT8_WEIGHTS_REL,
}
FLOAT8_ROWWISE_RUN = {**FLOAT8_TENSORWISE_RUN, "reference": "float8_rowwise"}
MX_REL = 2e-3  # emulated MXFP8 against float32, loss and grad_norm; 2.9x the largest drift measured (6.9e-4)
MX_RUN = {**FLOAT8_TENSORWISE_RUN, "reference": "mx_emulated"}
# LoRA over a float8 base against LoRA over float32: every adapter's gradient but the last block's comes back
# through the base's float8 matmuls (gradients in e5m2), so the adapters' grad_norm drifts more than a whole
# model's, whose norm the float32 output layer dominates: 5.4e-3 measured (2026-11-27); 3x that. The adapters'
# weights, 5 Adam steps away from lora_B's zeros, are up to 0.109 of their norm apart (wq.lora_B of block 0);
# 3x that still fails an adapter left untrained (1.0 of its norm) or trained on another layer's gradient.
LORA_FLOAT8_REL = 1.6e-2
LORA_FLOAT8_WEIGHTS_REL = 0.33


@dataclass(frozen=True)
class Layout:
    nproc: int
    flags: tuple[str, ...] = ()
    facts: dict = field(default_factory=dict)  # what rank 0 sees when the layout took effect
    reference: str = "one_process"
    rel: float = EXACT
    loss_atol: float = 0.0  # added to rel x |loss|: for a loss that is a cancellation near 0 (GENERATING)
    weights_atol: float | None = WEIGHTS_ATOL  # None: not compared (float8 rounds every matmul)
    weights_rel: float | None = None  # each weight's distance from the reference's, over the reference's norm
    refused: str | None = None  # the trainer's refusal, instead of a run
    resumed_at: int | None = None  # resumes `reference` from its save of this step; logs the steps after it


P = "--parallelism."
TP, CP, REPLICATE = (
    f"{P}tensor_parallel_degree",
    f"{P}context_parallel_degree",
    f"{P}data_parallel_replicate_degree",
)
SELECTIVE = ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option")
ACCUMULATE_TO_4 = ("--training.global_batch_size", "4")
FLOAT8 = ("--model.converters", "float8", "--quantize.linear.float8.recipe_name")
LINEAR_TYPES = {"linear_types": ["Float8Linear", "Linear"]}
MX = ("--model.converters", "mx", "--quantize.linear.mx.recipe_name", "mxfp8_emulated")
FLOAT8_ALL_GATHER = (
    "--quantize.linear.float8.enable_fsdp_float8_all_gather",
    "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
)
FLOAT8_WEIGHT_TYPE = "WeightWithDynamicFloat8CastTensor"  # a weight FSDP all-gathers in float8
# The styles that split wq and feed the attention (torchao's float8 ones, or torch's plain ones).
FLOAT8_TP_STYLES = {**LINEAR_TYPES, "tp_styles": ["Float8ColwiseParallel", "PrepareFloat8ModuleInput"]}
PLAIN_TP_STYLES = {**LINEAR_TYPES, "tp_styles": ["ColwiseParallel", "PrepareModuleInput"]}
# The blocks rank 0 holds, per stage. torchtitan's split counts the embedding and the output as a layer
# each: 4 layers over 4 stages are [emb, 0] [1, 2] [3] [norm, output], and 2 layers over 4 stages one unit each.
ONE_STAGE, LOOPED, V, ONE_UNIT_LOOPED = [["0"]], [["0"], ["3"]], [["0"], []], [[], ["1"]]
CSV_SCHEDULE = Path(__file__).parent / "assets" / "pp_two_stages_per_rank_4_microbatches.csv"
# Validation at step 5 on 2 batches of the bundled corpus, dealt like the training data.
VALIDATION = (
    "--validation.enable",
    "--validation.dataset",
    "c4_test",
    "--validation.seq_len",
    "64",
    "--validation.local_batch_size",
    "4",
    "--validation.freq",
    "5",
    "--validation.steps",
    "2",
    "--validation.dataloader.num_streams",
    "4",
)
BLOCK_CAUSAL, VARLEN = (
    ("--model.flavor", "debug_2_layers_block_causal"),
    ("--model.flavor", "debug_2_layers_varlen"),
)
IN_BACKWARD = ("--optimizer.early_step_in_backward",)
PTRR = ("--parallelism.context_parallel_load_balancer", "ptrr")
LOADER_WORKERS = (
    "--training.dataloader.num_workers",
    "2",
    "--training.dataloader.pin_memory",
    "--training.dataloader.persistent_workers",
    "--training.dataloader.prefetch_factor",
    "4",
)


def local_batch(n: int) -> tuple[str, ...]:
    return ("--training.local_batch_size", str(n))


SAVE_AT_3 = ("--checkpoint.enable", "--checkpoint.interval", "3", "--checkpoint.keep_latest_k", "0")
# 6 windows a step from 8 streams: resumed on 2 ranks, each rank's workers start at window 9 of its 4
# streams, mid-round and with the second worker's turn.
WORKERS_8_STREAMS = (
    *LOADER_WORKERS,
    "--training.dataloader.num_streams",
    "8",
    "--training.global_batch_size",
    "6",
    *SAVE_AT_3,
)


# A qwen3 mixture-of-experts model cut to dim 64, 2 layers of 8 experts (top 2, hidden 64): experts split by
# expert parallelism (ep, with etp = tp or 1) and FSDP over what ep leaves, against one process.
MOE = ("--model.name", "qwen3", "--model.flavor", "tiny_moe")
EP, ETP = f"{P}expert_parallel_degree", f"{P}expert_tensor_parallel_degree"
# gpt-oss cut alike (2 layers of 8 experts of width 32, top 4; window 16, so it bites at seq 64), against
# its own one-process run: sinks sharded by head under TP, experts' biases split or added once. Weights by
# each tensor's distance over its norm: under FSDP and PP one element of 131,072 in output.weight (a rare
# token's row, its gradient near zero, which Adam scales up to a whole update) moved 1.8e-4 while every
# tensor stayed within 2.6e-5 of its norm (2026-11-27).
GPT_OSS = ("--model.name", "gpt_oss", "--model.flavor", "tiny")
GPT_OSS_WEIGHTS_REL = 2e-4
# Qwen3.5's debug models cut to a full-attention block then a Gated DeltaNet block (tests/workers/
# layout_matrix.py), dense and MoE (8 experts, top 2), each against its own one process.
QWEN3_5 = ("--model.name", "qwen3_5", "--model.flavor", "debugmodel_2_layers")
QWEN3_5_MOE = ("--model.name", "qwen3_5", "--model.flavor", "debugmodel_moe_2_layers")
# Packed documents (block-causal attention; the linear layer's convolution and state restart at each document).
QWEN3_5_PACKED = ("--model.flavor", "debugmodel_flex_attn_2_layers")
# The linear layer's decay path (A_log, dt_bias, in_proj_a: gradients summed over every token's gate) moves with
# the summation order of a batch split: one process on the same 4 rows in 2 micro-batches of 2 moved A_log by
# 3.0e-5, as FSDP 2 and PP 2 did; CP 2 4.0e-5 (2026-12-02). 2.5x that; every other weight within 9e-6.
QWEN3_5_WEIGHTS_ATOL = 1e-4
LORA = ("--model.converters", "lora", "--lora.target_modules", "all-linear", "--lora.rank", "4")
QLORA = (*LORA, "--lora.quantize_base", "nf4")
# QLoRA's adapters start with B = 0, so Adam's first updates of A divide tiny gradients by their own size: the
# summation order of FSDP's reductions moves them by up to 4.9e-5 (measured 2026-12-02 in a full run; 1.1e-5 on
# 2026-11-27), 2x under this bound; the planted bug (each rank quantising its own shard) moved them 5.7e-3.
QLORA_WEIGHTS_ATOL = 1e-4
# Chat rows (the bundled arithmetic conversations, 40-90 tokens), packed two or three to a row of 128 with
# positions restarting per conversation, loss on the assistant turns: every row trains on another share of
# its tokens, so each layout must weigh its micro-batches by their trained tokens to match one process.
CHAT_DATA = Path(__file__).parents[1] / "packages/titan-data/src/titan_data/assets/chat_test/chat_test.jsonl"
CHAT = ("--training.dataset", "chat", "--training.dataset_path", str(CHAT_DATA), "--training.seq_len", "128")
CHAT_WEIGHTS_ATOL = 1e-4  # 3.4x the largest measured (2.9e-5, pp and accumulation; loss and grad_norm 3.3e-7)
# Preference pairs (the bundled file, TRL's three layouts) packed into rows of 128, DPO against a frozen
# copy of the starting weights, sharded like the policy: a pair is never split between ranks or
# micro-batches, and the step's loss is the mean over its pairs.
DPO_DATA = (
    Path(__file__).parents[1]
    / "packages/titan-data/src/titan_data/assets/preference_test/preference_test.jsonl"
)
DPO = (
    "--training.dataset",
    "preference",
    "--training.dataset_path",
    str(DPO_DATA),
    "--training.seq_len",
    "128",
)

UNEVEN = ("--training.seq_len", "160")
ORPO = ("--preference.loss", "orpo")

# GRPO (issue 59) on replayed rollouts: the bundled arithmetic prompts, 2 completions each, whose ids and lengths
# (1 to 8 tokens) `write_grpo_rollouts` draws for every step, so no layout generates; dapo (normalised by the
# step's completion tokens over every rank), beta 0.05 (a frozen copy, or the base with adapters off under
# LoRA), rewards scaled over the batch (so each advantage reads every rank's rewards).
PROMPTS_DATA = (
    Path(__file__).parents[1] / "packages/titan-data/src/titan_data/assets/prompts_test/prompts_test.jsonl"
)
ROLLOUTS = "<grpo rollouts>"  # the file the matrix writes in its folder (Matrix._flags)
GRPO = (
    *("--training.dataset", "prompts", "--training.dataset_path", str(PROMPTS_DATA)),
    *("--grpo.num_generations", "2", "--grpo.max_prompt_length", "48", "--grpo.max_completion_length", "8"),
    *("--grpo.reward_funcs", "grpo_layout_rewards:low_id_share", "--grpo.beta", "0.05"),
    *("--grpo.scale_rewards", "batch", "--grpo.replay_rollouts", ROLLOUTS),
)  # fmt: skip
# The titan engine drawing the rollouts: every completion runs to max_completion_length (a random model almost
# never ends one), so the batch's advantages cancel over equal lengths and the on-policy loss is little more
# than beta x kl (0 at step 1, ~1e-5 at step 2, where the layouts differ by ~1e-9): compared to GENERATING_LOSS_ATOL
# beside EXACT. grad_norm, kl, entropy and the weights still carry the comparison.
GENERATING = GRPO[: GRPO.index("--grpo.replay_rollouts")]
GENERATING_LOSS_ATOL = 5e-8  # 5x the largest measured (1.0e-8, EP 2; TP 2 9.3e-9)
GRPO_METRICS = ("reward", "reward_std", "kl", "entropy")  # TRL's names; each step's, over the global batch


def write_grpo_rollouts(path: Path, steps: int = STEPS, prompts: int = 64, generations: int = 2) -> None:
    """A rollout log (titan_train.objectives.rollouts) of `generations` completions of each of the first
    `prompts` prompts at every step, drawn from a seeded generator: 1 to 8 ids below the tokenizer's 2048,
    none an end id (each counts as cut at max_completion_length)."""
    g = torch.Generator().manual_seed(59)
    lines = []
    for step in range(1, steps + 1):
        for index in range(prompts):
            for _ in range(generations):
                length = int(torch.randint(1, 9, (), generator=g))
                ids = torch.randint(100, 2000, (length,), generator=g).tolist()
                lines.append(json.dumps({"step": step, "prompt_index": index, "completion_ids": ids}))
    path.write_text("".join(line + "\n" for line in lines))


# DeepSeek-V3's MoE layer with a shared expert (tests/workers/tiny_moe_flavor.py), with the sequence-wise
# auxiliary loss on, against its own one process.
SHARED = (
    "--model.name",
    "deepseek_v3",
    "--model.flavor",
    "tiny_shared",
    "--model.moe_seq_aux_loss_coeff",
    "0.001",
)


# The same layer with one multi-token-prediction depth (DeepSeek-V3's MTP, an MoE block after the last),
# against its own one process; `mtp` names the depth each part holds and its experts' local shape.
MTP = (*SHARED, "--model.num_mtp_layers", "1")


MTP_WHOLE, MTP_FSDP = {"eh_proj_placements": None}, {"eh_proj_placements": ["S(0)"]}


def mtp(nproc: int, flags: tuple[str, ...], facts: dict, **kwargs) -> Layout:
    return Layout(nproc, (*MTP, *flags), facts, reference="one_process_mtp", **kwargs)


def shared_expert(
    w1: list[str] | None, w1_local: list[int], w2: list[str] | None, w2_local: list[int]
) -> dict:
    """The first MoE layer's shared expert as a layout leaves it: w1's and w2's placements and local shapes."""
    return {"w1_placements": w1, "w1_local_shape": w1_local, "w2_placements": w2, "w2_local_shape": w2_local}


WHOLE_SHARED = shared_expert(None, [32, 64], None, [64, 32])
# Split like a dense feed-forward over tp, as torchtitan splits them: w1 by rows, w2 by columns.
SPLIT_SHARED = shared_expert(["S(0)"], [16, 64], ["S(1)"], [64, 16])


def shared(nproc: int, flags: tuple[str, ...], facts: dict, **kwargs) -> Layout:
    return Layout(nproc, (*SHARED, *flags), facts, reference="one_process_shared", **kwargs)


def experts(ep: int, etp: int, mesh_dims: list[str] | None, placements: list[str] | None, local: list[int]):
    return {
        "experts": {
            "ep": ep,
            "etp": etp,
            "w1_mesh_dims": mesh_dims,
            "w1_placements": placements,
            "w1_local_shape": local,
        }
    }


def moe(nproc: int, flags: tuple[str, ...], facts: dict, **kwargs) -> Layout:
    return Layout(nproc, (*MOE, *flags), facts, reference="one_process_moe", **kwargs)


def gpt_oss(nproc: int, flags: tuple[str, ...], facts: dict, **kwargs) -> Layout:
    kwargs = {"weights_atol": None, "weights_rel": GPT_OSS_WEIGHTS_REL, **kwargs}
    return Layout(nproc, (*GPT_OSS, *flags), facts, reference="one_process_gpt_oss", **kwargs)


def qwen3_5(nproc: int, flags: tuple[str, ...], facts: dict, **kwargs) -> Layout:
    kwargs = {"reference": "one_process_qwen3_5", "weights_atol": QWEN3_5_WEIGHTS_ATOL, **kwargs}
    return Layout(nproc, (*QWEN3_5, *flags), facts, **kwargs)


def linear_attention(
    qkv: list[str] | None, qkv_local: list[int], a_log: list[str] | None, a_log_local: list[int]
):
    """The first Gated DeltaNet layer as a layout leaves it: its q/k/v projection's and decay's splits."""
    return {
        "linear_attention": {
            "in_proj_qkv_placements": qkv,
            "in_proj_qkv_local_shape": qkv_local,
            "A_log_placements": a_log,
            "A_log_local_shape": a_log_local,
        }
    }


def pp(schedule: str, *flags: str) -> tuple[str, ...]:
    return (f"{P}pipeline_parallel_degree", "2", f"{P}pipeline_parallel_schedule", schedule, *flags)


def pp_schedule(schedule: str, stages: list[list[str]], *flags: str, **kwargs) -> Layout:
    return Layout(
        2, pp(schedule, *flags), {"schedule": f"Schedule{schedule}", "stage_blocks": stages}, **kwargs
    )


def cp(rotate_method: str) -> Layout:
    flags = (CP, "2", f"{P}context_parallel_rotate_method", rotate_method)
    return Layout(2, flags, {"degrees": {"cp": 2}, "cp_rotate_method": rotate_method})


# Muon's Newton-Schulz runs in float32 here (`optimizer.muon.ns_dtype`; bfloat16, torch.optim.Muon's and the
# default, is 29x slower on this CPU and is compared with torch.optim.Muon in test_muon.py), so the weights must
# agree to float32 rounding like every exact row (in bfloat16, gradients that differ from one process's by
# float noise round differently, and the matrices only land within a share of an update: 7.0e-4 of their norm
# measured on 2026-11-28).
MUON = ("--optimizer.name", "Muon", "--optimizer.muon.ns_dtype", "float32")
MUON_FACTS = {"optimizer": "Muon"}


def muon(nproc: int, flags: tuple[str, ...], facts: dict, **kwargs) -> Layout:
    kwargs = {"reference": "one_process_muon", **kwargs}
    return Layout(nproc, (*MUON, *flags), {**MUON_FACTS, **facts}, **kwargs)


LAYOUTS = {
    "one_process": Layout(
        1, VALIDATION, {"degrees": {}, "fsdp": False, "checkpointed_blocks": 0, "compiled_blocks": 0}
    ),
    "one_process_block_causal": Layout(
        1, BLOCK_CAUSAL, {"attn_backend": "sdpa"}, reference="one_process_block_causal"
    ),
    "one_process_4_layers": Layout(
        1, FOUR_LAYERS, {"stage_blocks": [["0", "1", "2", "3"]]}, reference="one_process_4_layers"
    ),
    "ac_full": Layout(1, ("--activation_checkpoint.mode", "full"), {"checkpointed_blocks": 2}),
    "ac_selective_every_2": Layout(1, (*SELECTIVE, "2"), {"checkpointed_blocks": 1}),
    "ac_selective_op": Layout(1, (*SELECTIVE, "op"), {"checkpointed_blocks": 2}),
    "compile": Layout(1, ("--compile.enable",), {"compiled_blocks": 2}),
    "float8_tensorwise": Layout(1, (*FLOAT8, "tensorwise"), LINEAR_TYPES, rel=FLOAT8_REL, weights_atol=None),
    "float8_rowwise": Layout(1, (*FLOAT8, "rowwise"), LINEAR_TYPES, rel=FLOAT8_REL, weights_atol=None),
    # float8 under TP against float8 in one process: tensorwise through torchao's float8 TP styles (activations
    # all-gathered in float8), rowwise through the plain ones; with FSDP, weights all-gathered in float8 too.
    "float8_tensorwise_tp": Layout(
        2,
        (*FLOAT8, "tensorwise", TP, "2"),
        {**FLOAT8_TP_STYLES, "degrees": {"tp": 2}},
        **FLOAT8_TENSORWISE_RUN,
    ),
    "float8_rowwise_tp": Layout(
        2, (*FLOAT8, "rowwise", TP, "2"), {**PLAIN_TP_STYLES, "degrees": {"tp": 2}}, **FLOAT8_ROWWISE_RUN
    ),
    # MXFP8 through torchao's emulated recipe (this CPU has no MX matmuls): against float32, and under FSDP.
    "mx_emulated": Layout(1, MX, {"linear_types": ["Linear", "MXLinear"]}, rel=MX_REL, weights_atol=None),
    "float8_rowwise_with_gw_hp": Layout(
        1,
        (*FLOAT8, "rowwise_with_gw_hp"),
        refused="float8.recipe='rowwise_with_gw_hp' is unknown; choose one of ['tensorwise', 'rowwise']",
    ),
    "accumulate_2": Layout(1, (*local_batch(2), *ACCUMULATE_TO_4), {"grad_accum_steps": 2}),
    "fsdp": Layout(2, local_batch(2), {"degrees": {"dp_shard": 2}, "fsdp": True, "wq_placements": ["S(0)"]}),
    "ddp": Layout(
        2, (REPLICATE, "2", *local_batch(2)), {"degrees": {"dp_replicate": 2}, "wq_placements": ["R"]}
    ),
    "tp_sp_loss_parallel": Layout(
        2, (TP, "2"), {"degrees": {"tp": 2}, "fsdp": False, "wq_placements": ["S(0)"], "loss_parallel": True}
    ),
    "pp_1F1B": pp_schedule("1F1B", ONE_STAGE),
    "pp_GPipe": pp_schedule("GPipe", ONE_STAGE),
    **{
        f"pp_{schedule}": pp_schedule(schedule, stages, *FOUR_LAYERS, reference="one_process_4_layers")
        for schedule, stages in [
            ("Interleaved1F1B", LOOPED),
            ("LoopedBFS", LOOPED),
            ("InterleavedZeroBubble", LOOPED),
            ("ZBVZeroBubble", V),
            ("DualPipeV", V),
        ]
    },
    "pp_Interleaved1F1B_layers_per_stage_1": pp_schedule(
        "Interleaved1F1B", ONE_UNIT_LOOPED, f"{P}pipeline_parallel_layers_per_stage", "1"
    ),
    "pp_csv_schedule": Layout(
        2,
        pp("PipelineScheduleMulti", f"{P}pipeline_parallel_schedule_csv", str(CSV_SCHEDULE)),
        {"schedule": "_PipelineScheduleRuntime", "stage_blocks": ONE_UNIT_LOOPED},
    ),
    "pp_1F1B_validation": pp_schedule("1F1B", ONE_STAGE, *VALIDATION),
    "early_step_in_backward": Layout(1, IN_BACKWARD, {"optimizer_in_backward": True}),
    "early_step_in_backward_accumulate_2": Layout(
        1,
        (*IN_BACKWARD, *local_batch(2), *ACCUMULATE_TO_4),
        refused="early_step_in_backward: gradient accumulation (2 micro-batches) needs every micro-batch",
    ),
    "varlen": Layout(1, VARLEN, {"attn_backend": "varlen"}, reference="one_process_block_causal"),
    "fsdp_varlen_ac_selective_op": Layout(
        2,
        (*VARLEN, *local_batch(2), *SELECTIVE, "op"),
        {"attn_backend": "varlen", "fsdp": True, "checkpointed_blocks": 2},
        reference="one_process_block_causal",
    ),
    "fsdp_cpu_offload_early_step_in_backward": Layout(
        2,
        (*local_batch(2), "--training.enable_cpu_offload", *IN_BACKWARD),
        {"fsdp": True, "optimizer_in_backward": True},
    ),
    "fsdp_loader_workers": Layout(
        2, (*local_batch(2), *LOADER_WORKERS, *SAVE_AT_3), {"fsdp": True, "loader_workers": 2}
    ),
    "fsdp_loader_workers_resumed": Layout(
        2,
        (*local_batch(2), *LOADER_WORKERS, *SAVE_AT_3),
        {"fsdp": True, "loader_workers": 2},
        reference="fsdp_loader_workers",
        rel=0.0,
        weights_atol=0.0,
        resumed_at=3,
    ),
    "one_process_loader_workers_8_streams": Layout(
        1,
        (*local_batch(6), *WORKERS_8_STREAMS),
        {"loader_workers": 2},
        reference="one_process_loader_workers_8_streams",
    ),
    "one_process_loader_workers_8_streams_resumed_on_2_ranks": Layout(
        2,
        (*local_batch(3), *WORKERS_8_STREAMS),
        {"fsdp": True, "loader_workers": 2},
        reference="one_process_loader_workers_8_streams",
        resumed_at=3,
    ),
    "cp_allgather": cp("allgather"),
    "cp_alltoall": cp("alltoall"),
    "fsdp_accumulate_2": Layout(
        2, (*local_batch(1), *ACCUMULATE_TO_4), {"grad_accum_steps": 2, "fsdp": True}
    ),
    "pp_accumulate_2": Layout(2, (*pp("1F1B"), *local_batch(2), *ACCUMULATE_TO_4), {"grad_accum_steps": 2}),
    "hsdp": Layout(
        4,
        (REPLICATE, "2", *local_batch(1)),
        {"degrees": {"dp_replicate": 2, "dp_shard": 2}, "wq_placements": ["R", "S(0)"]},
    ),
    "mx_emulated_fsdp": Layout(
        2, (*MX, *local_batch(2)), {"linear_types": ["Linear", "MXLinear"], "fsdp": True}, **MX_RUN
    ),
    "tp_fsdp": Layout(4, (TP, "2", *local_batch(2)), {"degrees": {"dp_shard": 2, "tp": 2}, "fsdp": True}),
    "pp_fsdp": Layout(4, (*pp("1F1B"), *local_batch(2)), {"degrees": {"pp": 2, "dp_shard": 2}, "fsdp": True}),
    "pp_tp": Layout(
        4, pp("1F1B", TP, "2", *VALIDATION), {"degrees": {"pp": 2, "tp": 2}, "wq_placements": ["S(0)"]}
    ),
    "float8_tensorwise_tp_fsdp_float8_all_gather": Layout(
        4,
        (*FLOAT8, "tensorwise", TP, "2", *local_batch(2), *FLOAT8_ALL_GATHER),
        {
            **FLOAT8_TP_STYLES,
            "degrees": {"dp_shard": 2, "tp": 2},
            "fsdp": True,
            "wq_local_type": FLOAT8_WEIGHT_TYPE,
        },
        **FLOAT8_TENSORWISE_RUN,
    ),
    "cp_fsdp": Layout(4, (CP, "2", *local_batch(2)), {"degrees": {"dp_shard": 2, "cp": 2}, "fsdp": True}),
    # ptrr and packed documents: the batch dealt per row, keys and values gathered (gathered_context_parallel).
    "cp_ptrr": Layout(2, (CP, "2", *PTRR), {"degrees": {"cp": 2}, "cp_load_balancer": "ptrr"}),
    "block_causal_cp2": Layout(
        2, (*BLOCK_CAUSAL, CP, "2"), {"cp_load_balancer": "headtail"}, reference="one_process_block_causal"
    ),
    "block_causal_cp2_ptrr": Layout(
        2, (*BLOCK_CAUSAL, CP, "2", *PTRR), {"cp_load_balancer": "ptrr"}, reference="one_process_block_causal"
    ),
    "one_process_moe": moe(1, (), experts(1, 1, None, None, [8, 64, 64])),
    "moe_tp": moe(2, (TP, "2"), experts(1, 1, ["tp"], ["S(1)"], [8, 32, 64])),
    "moe_ep2": moe(
        2, (EP, "2", *local_batch(2)), experts(2, 1, ["efsdp", "ep"], ["_S(0, 2)", "S(0)"], [4, 64, 64])
    ),
    "moe_ep2_fsdp": moe(
        4,
        (EP, "2", *local_batch(1), *SAVE_AT_3),
        experts(2, 1, ["efsdp", "ep"], ["_S(0, 2)", "S(0)"], [2, 64, 64]),
    ),
    # ep 4 over dp_shard 2 x tp 2 (etp 1): each tp rank dispatches its slice of the replicated rows.
    "moe_ep4_borrowing_tp": moe(
        4,
        (EP, "4", TP, "2", *local_batch(2)),
        experts(4, 1, ["efsdp", "ep"], ["_S(0, 4)", "S(0)"], [2, 64, 64]),
    ),
    "moe_ep2_etp2_tp2": moe(
        4,
        (EP, "2", ETP, "2", TP, "2", *local_batch(2)),
        experts(2, 2, ["efsdp", "ep", "etp"], ["_S(0, 2)", "S(0)", "S(1)"], [4, 32, 64]),
    ),
    "moe_ep2_cp2": moe(
        4,
        (EP, "2", CP, "2", *local_batch(2)),
        experts(2, 1, ["efsdp", "ep"], ["_S(0, 2)", "S(0)"], [2, 64, 64]),
    ),
    "moe_ep2_pp2": moe(
        4,
        (*pp("1F1B", EP, "2"), *local_batch(2)),
        experts(2, 1, ["efsdp", "ep"], ["_S(0, 2)", "S(0)"], [4, 64, 64]),
    ),
    # Saved at ep 2 on 4 ranks (experts as DTensors), resumed at ep 1 on 2 ranks.
    "moe_ep2_fsdp_resumed_at_ep1_on_2_ranks": Layout(
        2,
        (*MOE, *local_batch(2), *SAVE_AT_3),
        experts(1, 1, ["dp_shard"], ["S(0)"], [4, 64, 64]),
        reference="moe_ep2_fsdp",
        resumed_at=3,
    ),
    # ... and at ep 4 on the same 4 ranks (experts resharded from 4 per rank over efsdp 2 to 2 per rank).
    "moe_ep2_fsdp_resumed_at_ep4": Layout(
        4,
        (*MOE, EP, "4", *local_batch(1), *SAVE_AT_3),
        experts(4, 1, ["efsdp", "ep"], ["_S(0, 4)", "S(0)"], [2, 64, 64]),
        reference="moe_ep2_fsdp",
        resumed_at=3,
    ),
    # Per-op checkpointing around the experts' own FSDP unit (efsdp 1): a recomputed MoE forward does not
    # count its tokens again, so the logged counts are one process's.
    "moe_ep2_selective_op": moe(
        2,
        (EP, "2", *local_batch(2), *SELECTIVE, "op"),
        {**experts(2, 1, ["efsdp", "ep"], ["_S(0, 2)", "S(0)"], [4, 64, 64]), "checkpointed_blocks": 2},
    ),
    "one_process_gpt_oss": gpt_oss(1, (), experts(1, 1, None, None, [8, 64, 64])),
    "gpt_oss_fsdp": gpt_oss(2, local_batch(2), {"degrees": {"dp_shard": 2}, "fsdp": True}),
    "gpt_oss_tp": gpt_oss(
        2, (TP, "2"), {"wq_placements": ["S(0)"], **experts(1, 1, ["tp"], ["S(1)"], [8, 32, 64])}
    ),
    "gpt_oss_ep2": gpt_oss(
        2, (EP, "2", *local_batch(2)), experts(2, 1, ["efsdp", "ep"], ["_S(0, 2)", "S(0)"], [4, 64, 64])
    ),
    "gpt_oss_pp2": gpt_oss(2, pp("1F1B"), {"schedule": "Schedule1F1B", "stage_blocks": ONE_STAGE}),
    "gpt_oss_compile": gpt_oss(1, ("--compile.enable",), {"compiled_attentions": 2}),
    # Sinks and the 16-position window across load-balanced shards (positions 0-15 and 48-63 on rank 0):
    # keys and values gathered, masks from global positions (tests/test_gpt_oss_context_parallel.py). Loss
    # within 6e-8, grad_norm 1e-7, weights 6.7e-6 of their norm; each rank attending over its own slice
    # (the model not handed its shard) put grad_norm 2.7e-4 off (2026-11-27).
    "gpt_oss_cp2": gpt_oss(2, (CP, "2"), {"degrees": {"cp": 2}, "cp_rotate_method": "allgather"}),
    "gpt_oss_cp2_alltoall": gpt_oss(
        2,
        (CP, "2", f"{P}context_parallel_rotate_method", "alltoall"),
        {},
        refused="gpt_oss tiny gathers the whole sequence's keys and values",
    ),
    # Qwen3.5: FSDP 2, TP 2 (both kinds of layer split by head), PP 2 (1F1B: the full-attention block on rank 0,
    # the linear one on rank 1), CP 2 (the linear layer gathering the whole sequence) and, on the MoE cut, EP 2.
    "one_process_qwen3_5": qwen3_5(1, (), linear_attention(None, [512, 256], None, [8])),
    "qwen3_5_fsdp": qwen3_5(
        2,
        local_batch(2),
        {"degrees": {"dp_shard": 2}, **linear_attention(["S(0)"], [256, 256], ["S(0)"], [4])},
    ),
    "qwen3_5_tp": qwen3_5(
        2,
        (TP, "2"),
        {
            "degrees": {"tp": 2},
            "wq_placements": ["S(0)"],
            "loss_parallel": True,
            **linear_attention(["S(0)"], [256, 256], ["S(0)"], [4]),
        },
    ),
    "qwen3_5_pp2": qwen3_5(2, pp("1F1B"), {"schedule": "Schedule1F1B", "stage_blocks": ONE_STAGE}),
    "qwen3_5_cp2": qwen3_5(
        2,
        (CP, "2", f"{P}context_parallel_rotate_method", "allgather"),
        {"degrees": {"cp": 2}, "cp_rotate_method": "allgather"},
    ),
    # On packed documents (the block-causal cut, its own one process): FSDP 2, TP 2, PP 2, full activation
    # checkpointing and compile (packed rows under CP are refused: test_qwen3_5_training.py).
    "one_process_qwen3_5_packed": qwen3_5(
        1, QWEN3_5_PACKED, {"attn_backend": "flex"}, reference="one_process_qwen3_5_packed"
    ),
    **{
        f"qwen3_5_packed_{name}": qwen3_5(
            nproc, (*QWEN3_5_PACKED, *flags), facts, reference="one_process_qwen3_5_packed"
        )
        for name, nproc, flags, facts in [
            ("fsdp", 2, local_batch(2), {"degrees": {"dp_shard": 2}, "fsdp": True}),
            (
                "tp",
                2,
                (TP, "2"),
                {"degrees": {"tp": 2}, **linear_attention(["S(0)"], [256, 256], ["S(0)"], [4])},
            ),
            ("pp2", 2, pp("1F1B"), {"schedule": "Schedule1F1B", "stage_blocks": ONE_STAGE}),
            ("ac_full", 1, ("--activation_checkpoint.mode", "full"), {"checkpointed_blocks": 2}),
            ("compile", 1, ("--compile.enable",), {"compiled_blocks": 2}),
        ]
    },
    "one_process_qwen3_5_moe": Layout(
        1, QWEN3_5_MOE, experts(1, 1, None, None, [8, 128, 256]), reference="one_process_qwen3_5_moe"
    ),
    "qwen3_5_moe_ep2": Layout(
        2,
        (*QWEN3_5_MOE, EP, "2", *local_batch(2)),
        experts(2, 1, ["efsdp", "ep"], ["_S(0, 2)", "S(0)"], [4, 128, 256]),
        reference="one_process_qwen3_5_moe",
        weights_atol=QWEN3_5_WEIGHTS_ATOL,
    ),
    # Shared experts (one per layer, hidden 32) under tp (split over it), ep borrowing tp, and pp, against
    # one process.
    "one_process_shared": shared(1, (), {"shared_experts": WHOLE_SHARED}),
    "shared_tp": shared(
        2,
        (TP, "2"),
        {
            "degrees": {"tp": 2},
            **experts(1, 1, ["tp"], ["S(1)"], [8, 16, 64]),
            "shared_experts": SPLIT_SHARED,
        },
    ),
    "shared_ep2_tp2": shared(
        2,
        (EP, "2", TP, "2"),
        {
            **experts(2, 1, ["efsdp", "ep"], ["_S(0, 2)", "S(0)"], [4, 32, 64]),
            "shared_experts": SPLIT_SHARED,
        },
    ),
    "shared_pp2": shared(
        2,
        pp("1F1B"),
        {"stage_blocks": ONE_STAGE, "shared_experts": WHOLE_SHARED},
    ),
    # Multi-token prediction: its loss and experts under FSDP 2, EP 2 (over FSDP 2 of the rest), PP 2 and TP 2,
    # against one process (PP with TP is refused at start: packages/titan-train/tests/test_mtp.py).
    "one_process_mtp": mtp(
        1, (), {"mtp": {"layers": ["2"], **MTP_WHOLE, "w1_placements": None, "w1_local_shape": [8, 32, 64]}}
    ),
    "mtp_fsdp": mtp(
        2,
        local_batch(2),
        {
            "degrees": {"dp_shard": 2},
            "fsdp": True,
            "mtp": {"layers": ["2"], **MTP_FSDP, "w1_placements": ["S(0)"], "w1_local_shape": [4, 32, 64]},
        },
    ),
    "mtp_ep2": mtp(
        2,
        (EP, "2", *local_batch(2)),
        {
            "fsdp": True,
            **experts(2, 1, ["efsdp", "ep"], ["_S(0, 2)", "S(0)"], [4, 32, 64]),
            "mtp": {
                "layers": ["2"],
                **MTP_FSDP,
                "w1_placements": ["_S(0, 2)", "S(0)"],
                "w1_local_shape": [4, 32, 64],
            },
        },
    ),
    # Under PP 2 (1F1B) the depth sits on the last stage (rank 1), fed the embeddings the first stage carries.
    "mtp_pp": mtp(2, pp("1F1B"), {"schedule": "Schedule1F1B", "stage_blocks": ONE_STAGE, "mtp": None}),
    # Under TP 2 the depth's projection is split by output column (its block's experts over tp, as moe_tp's).
    "mtp_tp": mtp(
        2,
        (TP, "2"),
        {
            "degrees": {"tp": 2},
            "loss_parallel": True,
            "mtp": {
                "layers": ["2"],
                "eh_proj_placements": ["S(0)"],
                "w1_placements": ["S(1)"],
                "w1_local_shape": [8, 16, 64],
            },
        },
    ),
    "dense_model_ep2": Layout(
        2, (EP, "2", *local_batch(2)), refused="llama3 debug_2_layers has no experts to split"
    ),
    # LoRA (adapters on every linear but the output, the base frozen) against LoRA in one process.
    "one_process_lora": Layout(1, LORA, {"degrees": {}, "fsdp": False}, reference="one_process_lora"),
    "lora_fsdp": Layout(
        2, (*LORA, *local_batch(2)), {"degrees": {"dp_shard": 2}, "fsdp": True}, reference="one_process_lora"
    ),
    # QLoRA (the adapted layers' frozen base in NF4) under FSDP 2 against QLoRA in one process: the same NF4 codes.
    "one_process_qlora": Layout(1, QLORA, {"degrees": {}, "fsdp": False}, reference="one_process_qlora"),
    "qlora_fsdp": Layout(
        2,
        (*QLORA, *local_batch(2)),
        {"degrees": {"dp_shard": 2}, "fsdp": True, "wq_local_type": "NF4Tensor"},
        reference="one_process_qlora",
        weights_atol=QLORA_WEIGHTS_ATOL,
    ),
    "qlora_hsdp": Layout(
        4,
        (*QLORA, REPLICATE, "2", *local_batch(1)),
        {"degrees": {"dp_replicate": 2, "dp_shard": 2}, "wq_local_type": "NF4Tensor"},
        reference="one_process_qlora",
        weights_atol=QLORA_WEIGHTS_ATOL,
    ),
    "lora_pp_1F1B": Layout(
        2,
        (*LORA, *pp("1F1B")),
        {"schedule": "Schedule1F1B", "stage_blocks": ONE_STAGE},
        reference="one_process_lora",
    ),
    "lora_compile": Layout(
        1, (*LORA, "--compile.enable"), {"compiled_blocks": 2}, reference="one_process_lora"
    ),
    # Adapters follow the split of their layer: colwise wq -> A replicated, B rows split; rowwise wo -> A columns
    # split, B replicated. FSDP over the tp split (4 ranks) shards them along dp_shard too.
    "lora_tp": Layout(
        2,
        (*LORA, TP, "2"),
        {
            "degrees": {"tp": 2},
            "lora_placements": {
                "wq.lora_A": ["R"],
                "wq.lora_B": ["S(0)"],
                "wo.lora_A": ["S(1)"],
                "wo.lora_B": ["R"],
            },
        },
        reference="one_process_lora",
    ),
    # LoRA under context parallelism (the adapters see the rank's sequence shard, like their layer), over a
    # frozen float8 base (tensorwise, against LoRA over float32: float8's rounding, like float8_tensorwise), and
    # on a mixture-of-experts model under ep 2 (attention adapters only: routed experts stay frozen, whole).
    "lora_cp2": Layout(2, (*LORA, CP, "2"), {"degrees": {"cp": 2}}, reference="one_process_lora"),
    "lora_float8": Layout(
        1,
        (
            "--model.converters",
            "float8,lora",
            *LORA[2:],
            "--quantize.linear.float8.recipe_name",
            "tensorwise",
        ),
        LINEAR_TYPES,
        reference="one_process_lora",
        rel=LORA_FLOAT8_REL,
        weights_atol=None,
        weights_rel=LORA_FLOAT8_WEIGHTS_REL,
    ),
    "one_process_lora_moe": Layout(1, (*MOE, *LORA), {"degrees": {}}, reference="one_process_lora_moe"),
    "lora_moe_ep2": Layout(
        2,
        (*MOE, *LORA, EP, "2", *local_batch(2)),
        experts(2, 1, ["efsdp", "ep"], ["_S(0, 2)", "S(0)"], [4, 64, 64]),
        reference="one_process_lora_moe",
    ),
    # Packed chat rows against one process on the same rows: positions and document masks through FSDP, TP
    # (vocabulary-sharded loss), gradient accumulation, pipeline stages and context parallelism (head-tail, ptrr).
    "one_process_chat": Layout(1, CHAT, {"degrees": {}}, reference="one_process_chat"),
    "chat_fsdp": Layout(
        2,
        (*CHAT, *local_batch(2)),
        {"degrees": {"dp_shard": 2}, "fsdp": True},
        reference="one_process_chat",
        weights_atol=CHAT_WEIGHTS_ATOL,
    ),
    "chat_fsdp_accumulate_2": Layout(
        2,
        (*CHAT, *local_batch(1), *ACCUMULATE_TO_4),
        {"grad_accum_steps": 2, "fsdp": True},
        reference="one_process_chat",
        weights_atol=CHAT_WEIGHTS_ATOL,
    ),
    "chat_tp": Layout(
        2,
        (*CHAT, TP, "2"),
        {"degrees": {"tp": 2}, "loss_parallel": True},
        reference="one_process_chat",
        weights_atol=CHAT_WEIGHTS_ATOL,
    ),
    "chat_pp_1F1B": Layout(
        2,
        (*CHAT, *pp("1F1B")),
        {"schedule": "Schedule1F1B", "stage_blocks": ONE_STAGE},
        reference="one_process_chat",
        weights_atol=CHAT_WEIGHTS_ATOL,
    ),
    "chat_cp2": Layout(
        2,
        (*CHAT, CP, "2"),
        {"degrees": {"cp": 2}, "cp_load_balancer": "headtail"},
        reference="one_process_chat",
        weights_atol=CHAT_WEIGHTS_ATOL,
    ),
    "chat_cp2_ptrr": Layout(
        2,
        (*CHAT, CP, "2", *PTRR),
        {"degrees": {"cp": 2}, "cp_load_balancer": "ptrr"},
        reference="one_process_chat",
        weights_atol=CHAT_WEIGHTS_ATOL,
    ),
    "chat_cp2_alltoall": Layout(
        2,
        (*CHAT, CP, "2", f"{P}context_parallel_rotate_method", "alltoall"),
        reference="one_process_chat",
        refused="over packed documents gathers every rank's keys and values; set it to 'allgather'",
    ),
    "one_process_dpo": Layout(1, DPO, {"degrees": {}}, reference="one_process_dpo"),
    "dpo_fsdp": Layout(
        2,
        (*DPO, *local_batch(2)),
        {"degrees": {"dp_shard": 2}, "fsdp": True},
        reference="one_process_dpo",
        weights_atol=CHAT_WEIGHTS_ATOL,
    ),
    "dpo_fsdp_accumulate_2": Layout(
        2,
        (*DPO, *local_batch(1), *ACCUMULATE_TO_4),
        {"grad_accum_steps": 2, "fsdp": True},
        reference="one_process_dpo",
        weights_atol=CHAT_WEIGHTS_ATOL,
    ),
    # Vocabulary-sharded logits (loss parallelism): each sequence's log-probs taken without gathering the vocabulary.
    "dpo_tp": Layout(
        2,
        (*DPO, TP, "2"),
        {"degrees": {"tp": 2}, "loss_parallel": True},
        reference="one_process_dpo",
        weights_atol=CHAT_WEIGHTS_ATOL,
    ),
    "dpo_compile": Layout(1, (*DPO, "--compile.enable"), {"compiled_blocks": 2}, reference="one_process_dpo"),
    # Context parallelism: each window dealt to the ranks once its sequences are numbered, per-sequence sums
    # added up over the group (preference_step); head-tail and ptrr, DPO against its frozen copy and ORPO.
    "dpo_cp2": Layout(
        2,
        (*DPO, CP, "2"),
        {"degrees": {"cp": 2}, "cp_load_balancer": "headtail"},
        reference="one_process_dpo",
        weights_atol=CHAT_WEIGHTS_ATOL,
    ),
    "dpo_cp2_ptrr": Layout(
        2,
        (*DPO, CP, "2", *PTRR),
        {"degrees": {"cp": 2}, "cp_load_balancer": "ptrr"},
        reference="one_process_dpo",
        weights_atol=CHAT_WEIGHTS_ATOL,
    ),
    # Two pipeline stages (1F1B, a microbatch a window): the pair loss on the last stage, the frozen copy's
    # log-probs from its own forward-only pipeline pass over the same microbatches.
    "dpo_pp": Layout(
        2,
        (*DPO, *pp("1F1B")),
        {"schedule": "Schedule1F1B", "stage_blocks": ONE_STAGE},
        reference="one_process_dpo",
        weights_atol=CHAT_WEIGHTS_ATOL,
    ),
    # Windows of 160 tokens hold 1 or 2 pairs, so a step's microbatches hold different numbers of pairs: a
    # loss averaged per microbatch rather than per pair shows (with 128, every window holds one pair).
    "one_process_dpo_uneven": Layout(1, (*DPO, *UNEVEN), {"degrees": {}}, reference="one_process_dpo_uneven"),
    # The reference log-probs precomputed by the policy's own pipeline, forward only, before step 1.
    "dpo_pp_precompute": Layout(
        2,
        (*DPO, *UNEVEN, *pp("1F1B"), "--preference.reference", "precompute"),
        {"schedule": "Schedule1F1B", "stage_blocks": ONE_STAGE},
        reference="one_process_dpo_uneven",
        weights_atol=CHAT_WEIGHTS_ATOL,
    ),
    # ORPO (no reference; its NLL term over the chosen sequences' tokens, the NLL targets a plane of the target).
    "one_process_orpo": Layout(1, (*DPO, *UNEVEN, *ORPO), {"degrees": {}}, reference="one_process_orpo"),
    "orpo_cp2": Layout(
        2,
        (*DPO, *UNEVEN, *ORPO, CP, "2"),
        {"degrees": {"cp": 2}},
        reference="one_process_orpo",
        weights_atol=CHAT_WEIGHTS_ATOL,
    ),
    "orpo_pp": Layout(
        2,
        (*DPO, *UNEVEN, *ORPO, *pp("1F1B")),
        {"schedule": "Schedule1F1B", "stage_blocks": ONE_STAGE},
        reference="one_process_orpo",
        weights_atol=CHAT_WEIGHTS_ATOL,
    ),
    # DPO on the qwen3 MoE cut: experts split by expert parallelism against the same cut in one process.
    "one_process_dpo_moe": Layout(
        1, (*MOE, *DPO), experts(1, 1, None, None, [8, 64, 64]), reference="one_process_dpo_moe"
    ),
    "dpo_moe_ep2": Layout(
        2,
        (*MOE, *DPO, EP, "2", *local_batch(2)),
        experts(2, 1, ["efsdp", "ep"], ["_S(0, 2)", "S(0)"], [4, 64, 64]),
        reference="one_process_dpo_moe",
        weights_atol=CHAT_WEIGHTS_ATOL,
    ),
    # The reference log-probs computed by the policy in one pass before step 1 (the 30B-A3B config's choice):
    # both ranks take part in every forward of the pass, as the experts' all-to-all needs.
    "dpo_moe_ep2_precompute": Layout(
        2,
        (*MOE, *DPO, EP, "2", *local_batch(2), "--preference.reference", "precompute"),
        experts(2, 1, ["efsdp", "ep"], ["_S(0, 2)", "S(0)"], [4, 64, 64]),
        reference="one_process_dpo_moe",
        weights_atol=CHAT_WEIGHTS_ATOL,
    ),
    # Muon (the blocks' matrices orthogonalised whole: gathered from their shards) against Muon in one process.
    "one_process_muon": Layout(1, MUON, MUON_FACTS, reference="one_process_muon"),
    "muon_fsdp": muon(2, (*local_batch(2), *SAVE_AT_3), {"degrees": {"dp_shard": 2}}),
    "muon_tp": muon(2, (TP, "2"), {"degrees": {"tp": 2}}),
    "muon_pp": muon(2, pp("1F1B"), {"stage_blocks": ONE_STAGE}),
    "muon_hsdp": muon(4, (REPLICATE, "2", *local_batch(1)), {"degrees": {"dp_replicate": 2, "dp_shard": 2}}),
    "muon_tp_fsdp": muon(4, (TP, "2", *local_batch(2)), {"degrees": {"dp_shard": 2, "tp": 2}}),
    # Saved by muon_fsdp at step 3 (momentum sharded over 2 ranks), resumed over dp_shard 2 x tp 2.
    "muon_fsdp_resumed_as_tp_fsdp": muon(
        4,
        (TP, "2", *local_batch(2), *SAVE_AT_3),
        {"degrees": {"dp_shard": 2, "tp": 2}},
        reference="muon_fsdp",
        resumed_at=3,
    ),
    "one_process_muon_moe": Layout(1, (*MOE, *MUON), MUON_FACTS, reference="one_process_muon_moe"),
    "muon_moe_ep2": Layout(
        2,
        (*MOE, *MUON, EP, "2", *local_batch(2)),
        {**MUON_FACTS, **experts(2, 1, ["efsdp", "ep"], ["_S(0, 2)", "S(0)"], [4, 64, 64])},
        reference="one_process_muon_moe",
    ),
    # Expert tensor parallelism: each expert's matrix split by rows over etp, gathered whole for Newton-Schulz.
    "muon_moe_ep2_etp2_tp2": Layout(
        4,
        (*MOE, *MUON, EP, "2", ETP, "2", TP, "2", *local_batch(2)),
        {**MUON_FACTS, **experts(2, 2, ["efsdp", "ep", "etp"], ["_S(0, 2)", "S(0)", "S(1)"], [4, 32, 64])},
        reference="one_process_muon_moe",
    ),
    # GRPO on replayed rollouts (GRPO above): FSDP 2, TP 2 (log-probs and entropies from the vocabulary-sharded
    # logits), EP 2 on the qwen3 MoE cut, LoRA and QLoRA under FSDP 2 (the reference: the base with adapters
    # off), each against the same run in one process; pipeline and context parallelism are refused.
    "one_process_grpo": Layout(1, GRPO, {"degrees": {}}, reference="one_process_grpo"),
    # Planted (2026-12-02): advantages from the rank's own rewards, or dapo over its own tokens, fail this row.
    "grpo_fsdp2": Layout(
        2, (*GRPO, *local_batch(2)), {"degrees": {"dp_shard": 2}, "fsdp": True}, reference="one_process_grpo"
    ),
    "grpo_tp2": Layout(
        2, (*GRPO, TP, "2"), {"degrees": {"tp": 2}, "loss_parallel": True}, reference="one_process_grpo"
    ),
    "one_process_grpo_moe": Layout(
        1, (*MOE, *GRPO), experts(1, 1, None, None, [8, 64, 64]), reference="one_process_grpo_moe"
    ),
    "grpo_ep2": Layout(
        2,
        (*MOE, *GRPO, EP, "2", *local_batch(2)),
        experts(2, 1, ["efsdp", "ep"], ["_S(0, 2)", "S(0)"], [4, 64, 64]),
        reference="one_process_grpo_moe",
    ),
    "one_process_grpo_lora": Layout(1, (*GRPO, *LORA), {"degrees": {}}, reference="one_process_grpo_lora"),
    "grpo_lora": Layout(
        2,
        (*GRPO, *LORA, *local_batch(2)),
        {"degrees": {"dp_shard": 2}, "fsdp": True},
        reference="one_process_grpo_lora",
    ),
    "one_process_grpo_qlora": Layout(1, (*GRPO, *QLORA), {"degrees": {}}, reference="one_process_grpo_qlora"),
    "grpo_qlora": Layout(
        2,
        (*GRPO, *QLORA, *local_batch(2)),
        {"degrees": {"dp_shard": 2}, "fsdp": True, "wq_local_type": "NF4Tensor"},
        reference="one_process_grpo_qlora",
        weights_atol=QLORA_WEIGHTS_ATOL,
    ),
    "grpo_pp": Layout(
        2,
        (*GRPO, *pp("1F1B")),
        refused="parallelism.pipeline_parallel_degree > 1 (the GRPO step takes every completion token's log-prob",
    ),
    # The titan engine generating (sampled at temperature 1) under TP 2 (the tp ranks share their prompts; on an
    # unparallelised copy of the gathered weights) and EP 2 (each rank its own 2 prompts, decoded on the policy
    # with its experts split, the ranks stepping together: rollouts.lockstep), each completion seeded by its
    # prompt's index: the same rollouts as one process. EP's decoding on the split experts passed 2026-12-03. Planted (2026-12-03): the tp ranks'
    # seeds differing failed grpo_tp2_generating (the tp ranks' completions check); seeds of a rank's own
    # prompt positions (not their indices in the data) failed grpo_ep2_generating.
    "one_process_grpo_generating": Layout(
        1, GENERATING, {"degrees": {}}, reference="one_process_grpo_generating"
    ),
    "grpo_cp2": Layout(
        2,
        (*GRPO, CP, "2"),
        refused="parallelism.context_parallel_degree > 1 (generation does not split sequences)",
    ),
    "grpo_tp2_generating": Layout(
        2,
        (*GENERATING, TP, "2"),
        {"degrees": {"tp": 2}, "loss_parallel": True},
        reference="one_process_grpo_generating",
        loss_atol=GENERATING_LOSS_ATOL,
    ),
    "one_process_grpo_moe_generating": Layout(
        1,
        (*MOE, *GENERATING),
        experts(1, 1, None, None, [8, 64, 64]),
        reference="one_process_grpo_moe_generating",
    ),
    "grpo_ep2_generating": Layout(
        2,
        (*MOE, *GENERATING, EP, "2", *local_batch(2)),
        experts(2, 1, ["efsdp", "ep"], ["_S(0, 2)", "S(0)"], [4, 64, 64]),
        reference="one_process_grpo_moe_generating",
        loss_atol=GENERATING_LOSS_ATOL,
    ),
}


# The rows run in four launches, one torchrun per world size, in LAYOUTS' order (a resumed row after the row whose
# save it reads), and all in one unit of the suite's work (one worker: a launch resumed from another's save needs
# that launch's files): fewer, longer launches save CPU, and the suite is CPU-bound on CI's 2 cores. Each launch
# costs its launcher about 4 CPU-seconds and each rank about 11 (imports, joining the group) before its first row
# (2026-11-28: in 9 launches, 390 of the matrix's 944 CPU-seconds were outside rows). A row resumed from the save of
# a larger world runs in a fourth launch after that world's: the larger world's launch resumes saves of this size
# too (Muon's 4-rank row a 2-rank save, the MoE rows at ep 1 a 4-rank save), so no one launch can come first.
def _launches() -> dict[str, str]:
    """Each row's launch: "<n>ranks", or "<n>ranks-from-<m>ranks" for a row resumed from the save of m > n ranks."""
    launch = {}
    for name, layout in LAYOUTS.items():
        saved_by = LAYOUTS[layout.reference].nproc
        resumed_from_more = layout.resumed_at is not None and saved_by > layout.nproc
        launch[name] = f"{layout.nproc}ranks" + (f"-from-{saved_by}ranks" if resumed_from_more else "")
    return launch


LAUNCH = _launches()


class Matrix:
    """Starts each launch (see LAUNCH) on first use of one of its rows, and reads what each row wrote."""

    def __init__(self, folder: Path):
        self.folder, self.results = folder, {}
        self.failed: dict[str, str] = {}  # launch -> the first row that saw it fail

    def _flags(self, layout: Layout) -> list[str]:
        rollouts = self.folder / "grpo_rollouts.jsonl"
        if ROLLOUTS in layout.flags and not rollouts.exists():
            write_grpo_rollouts(rollouts)
        flags = [str(rollouts) if flag == ROLLOUTS else flag for flag in layout.flags]
        if layout.resumed_at is None:
            return [*BASE, *flags]
        saved = self.folder / LAUNCH[layout.reference] / layout.reference / "checkpoint"
        resume = ["--checkpoint.folder", str(saved), "--checkpoint.load_step", str(layout.resumed_at)]
        return [*BASE, *flags, *resume, "--checkpoint.load_only"]

    def _launch(self, launch: str) -> None:
        # A run resumed here from another launch's save needs that launch first.
        names = [name for name in LAYOUTS if LAUNCH[name] == launch]
        for name in names:
            reference = LAYOUTS[name].reference
            if LAYOUTS[name].resumed_at and LAUNCH[reference] != launch:
                self[reference]
        out = self.folder / launch
        out.mkdir()
        layouts = {name: self._flags(LAYOUTS[name]) for name in names}
        (out / "layouts.json").write_text(json.dumps(layouts))
        # One thread per rank, and inductor compiling in the rank itself: worker pools on 2 cores cost
        # more than they save (the one-rank launch takes 10x longer with 2 threads on a busy machine).
        result = run_torchrun(
            str(WORKER),
            str(out / "layouts.json"),
            str(out),
            nproc=LAYOUTS[names[0]].nproc,
            timeout=1800,  # a hang guard: the 2-rank launch trains 65 rows
            env={"TORCHINDUCTOR_COMPILE_THREADS": "1"},
        )
        output = result.stdout + result.stderr
        # A rank's native crash: its stack, not only the others' fallout.
        crash = output.find("Fatal Python error")
        assert result.returncode == 0, (output[crash : crash + 4000] if crash >= 0 else "") + output[-6000:]
        for name, value in json.loads((out / "results.json").read_text()).items():
            self.results[name] = {**value, "dump": out / name}

    def __getitem__(self, name: str) -> dict:
        launch = LAUNCH[name]
        if launch in self.failed:
            # Not launched twice: the first failure's output is the one to read.
            pytest.fail(f"the {launch} launch failed in {self.failed[launch]}; read that test's output")
        if name not in self.results:
            try:
                self._launch(launch)
            except BaseException:
                self.failed.setdefault(launch, name)
                raise
        return self.results[name]

    def metrics(self, name: str) -> dict[str, list[float]]:
        records = [
            json.loads(line) for line in (self[name]["dump"] / "metrics.jsonl").read_text().splitlines()
        ]
        assert [r["step"] for r in records] == list(range((LAYOUTS[name].resumed_at or 0) + 1, STEPS + 1))
        # MoE runs also log each step's tokens per expert, counted over the whole global batch; preference
        # runs TRL's rewards and log-probs.
        return {
            key: [r[key] for r in records]
            for key in ("loss", "grad_norm", "mtp_loss", "expert_counts", *PREFERENCE_METRICS, *GRPO_METRICS)
            if key in records[0]
        }

    def weights(self, name: str) -> dict[str, torch.Tensor]:
        """The whole model after the last step, put together from the ranks that wrote a piece."""
        merged = {}
        for path in sorted(self[name]["dump"].glob("weights_rank*.pt")):
            merged.update(torch.load(path))
        return merged


def seen(result: dict, layout: Layout) -> dict:
    """The facts of a run that the layout names."""
    return {key: result["facts"][key] for key in layout.facts}


def largest_relative_difference(got: list[float], want: list[float]) -> float:
    return max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    return Matrix(tmp_path_factory.mktemp("layout_matrix"))


def _trained() -> list:
    return [
        name
        for name, layout in LAYOUTS.items()
        if layout.refused is None and name != layout.reference and layout.resumed_at is None
    ]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["one_process", "one_process_4_layers"])
def test_one_process_reference_trains_five_distinct_clipped_steps(matrix, name):
    run = matrix.metrics(name)
    assert len(set(run["loss"])) == STEPS and len(set(run["grad_norm"])) == STEPS
    assert max(run["grad_norm"]) > 1.0  # above max_norm: clipping takes part in the comparison
    assert seen(matrix[name], LAYOUTS[name]) == LAYOUTS[name].facts


def assert_trains_as_its_reference(matrix, name: str) -> None:
    """The layout took effect and matches its reference run (from the step it resumed at) by loss,
    grad_norm at every step, and final weights."""
    layout = LAYOUTS[name]
    result = matrix[name]
    assert "refused" not in result, result["refused"]
    assert seen(result, layout) == layout.facts
    run, reference = matrix.metrics(name), matrix.metrics(layout.reference)
    for key in ("loss", "grad_norm", "mtp_loss"):
        if key not in reference:
            continue
        want = reference[key][layout.resumed_at or 0 :]
        if key == "loss" and layout.loss_atol:
            close = all(
                abs(g - w) <= layout.rel * abs(w) + layout.loss_atol
                for g, w in zip(run[key], want, strict=True)
            )
            assert close, f"{key}: {run[key]} against {layout.reference} {want}"
            continue
        difference = largest_relative_difference(run[key], want)
        assert difference <= layout.rel, f"{key}: {run[key]} against {layout.reference} {want}"
    for key in (*PREFERENCE_METRICS, *GRPO_METRICS):
        if key not in reference:
            continue
        # Step 1's rewards are 0 (the policy is its reference): relative to the value, or to 1 below it.
        want = reference[key][layout.resumed_at or 0 :]
        worst = max(abs(g - w) / max(abs(w), 1.0) for g, w in zip(run[key], want, strict=True))
        assert worst <= layout.rel, f"{key}: {run[key]} against {layout.reference} {want}"
    if "expert_counts" in reference:
        # Load balancing is layout-independent: counts summed over the data-parallel ranks move the expert
        # biases as in one process, so every step routes the same tokens to the same experts. Under a
        # pipeline the logging rank reports every stage's layers, not only its own.
        want = reference["expert_counts"][layout.resumed_at or 0 :]
        assert run["expert_counts"] == want, (run["expert_counts"], want)
    if layout.weights_atol is not None:
        got, want = matrix.weights(name), matrix.weights(layout.reference)
        assert sorted(got) == sorted(want)
        differences = {key: (got[key] - want[key]).abs().max().item() for key in want}
        worst = max(differences, key=differences.get)
        assert differences[worst] <= layout.weights_atol, f"{worst} differs by {differences[worst]:.2e}"
    if layout.weights_rel is not None:
        got, want = matrix.weights(name), matrix.weights(layout.reference)
        assert sorted(got) == sorted(want)
        distances = {key: ((got[key] - want[key]).norm() / want[key].norm()).item() for key in want}
        worst = max(distances, key=distances.get)
        assert distances[worst] <= layout.weights_rel, f"{worst} is {distances[worst]:.2e} of its norm away"


@pytest.mark.slow
@pytest.mark.parametrize("name", _trained())
def test_layout_trains_the_one_process_run_by_loss_grad_norm_and_weights(matrix, name):
    assert_trains_as_its_reference(matrix, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name, layout in LAYOUTS.items() if layout.resumed_at])
def test_run_resumed_with_loader_workers_continues_the_run_it_resumes(matrix, name):
    """Workers read ahead of the step, yet a save holds the position of the batches trained on."""
    saved_by = LAYOUTS[name].reference
    assert seen(matrix[saved_by], LAYOUTS[saved_by]) == LAYOUTS[saved_by].facts  # it had workers too
    assert_trains_as_its_reference(matrix, name)


def _validation_losses(matrix, name: str) -> list[float]:
    lines = (matrix[name]["dump"] / "validation.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pp_1F1B_validation", "pp_tp"])
def test_validation_under_pipeline_parallelism_measures_the_loss_of_one_process(matrix, name):
    """The schedule's forward-only path, on the pipeline's last stage, gives the validation loss of one process."""
    got, want = _validation_losses(matrix, name), _validation_losses(matrix, "one_process")
    assert len(want) == 1 and largest_relative_difference(got, want) <= EXACT, (got, want)


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name, layout in LAYOUTS.items() if layout.refused])
def test_layout_the_trainer_cannot_run_is_refused_with_the_reason(matrix, name):
    assert LAYOUTS[name].refused in matrix[name].get("refused", "accepted")


@pytest.mark.slow
@pytest.mark.parametrize("launch", sorted(set(LAUNCH.values())))
def test_each_layout_leaves_no_process_group_behind(matrix, launch):
    names = [name for name in LAYOUTS if LAUNCH[name] == launch]
    assert [matrix[name]["groups_after"] for name in names] == [1] * len(names)
