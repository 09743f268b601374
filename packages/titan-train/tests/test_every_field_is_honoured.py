"""No silent settings: every JobConfig field is honoured or refused, probe by probe.

Each probe changes one field (switching on what the field belongs to, in `base`) and launches
`titan-train` in this process (`field_probes.launch`). Honoured: what the launch did or wrote
(`observe`) differs from the same launch without the change. Refused: the launch stops at start with
exit status 2 and one line naming the field, while the base launch runs. Where a setting is handed to a
library (titan-parallel's ParallelOptions, titan-ckpt's Checkpointer), the probe observes what reached
it; the library's own tests prove it acts on it. `test_the_table_covers_every_field` fails for a field
with no probe, so a new field must be wired or refused before it lands.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from field_probes import Seen, launch, worker_counts
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from titan_models.deepseek_v3 import DEEPSEEK_V3_FLAVORS
from titan_models.qwen3 import QWEN3_FLAVORS, qwen3_moe_args
from titan_train.config import JobConfig
from titan_train.config.fields import iter_fields
from titan_train.faults import numerics as numerics_module
from titan_train.registry import register_flavor

ASSETS = Path(__file__).parents[2] / "titan-data" / "src" / "titan_data" / "assets"
BASE = (
    "--job.dump_folder",
    "out",
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--training.steps",
    "2",
    "--activation_checkpoint.mode",
    "none",
    "--metrics.log_freq",
    "1",
    "--lr_scheduler.warmup_steps",
    "1",
    "--metrics.disable_color_printing",
)
CKPT = ("--checkpoint.enable", "--checkpoint.interval", "1")
VALIDATION = (
    "--validation.enable",
    "--validation.dataset",
    "c4_test",
    "--validation.seq_len",
    "32",
    "--validation.local_batch_size",
    "2",
    "--validation.steps",
    "1",
    "--validation.freq",
    "1",
)
CHAT = ("--training.dataset", "chat", "--training.dataset_path", "chat.jsonl", "--training.seq_len", "64")
PREFERENCE = (
    "--training.dataset",
    "preference",
    "--training.dataset_path",
    "pairs.jsonl",
    "--training.seq_len",
    "64",
)
PROMPTS = (
    "--training.dataset", "prompts", "--training.dataset_path", "prompts.jsonl", "--training.seq_len", "64",
    "--training.local_batch_size", "4", "--grpo.num_generations", "2", "--grpo.max_prompt_length", "40",
    "--grpo.max_completion_length", "8", "--grpo.reward_funcs", "probe_rewards:length,probe_rewards:vowels",
)  # fmt: skip
JSON_DATA = ("--training.dataset", "json", "--training.dataset_path", "docs.jsonl")
SPLITS = ("--training.dataset", "json", "--training.dataset_path", "splits")  # a saved DatasetDict
# Eight windows hold about four documents: the weights decide whose they are.
MIXTURE = ("--training.dataset", "json", "--training.dataset_mixture", "docs.jsonl,docs2.jsonl")
MIXTURE += ("--training.local_batch_size", "8")
DRILL = ("--health.drill_step", "1", "--health.drill", "nan")
MEMORY_BUDGET = (
    "--activation_checkpoint.mode",
    "memory_budget",
    "--compile.enable",
    "--compile.backend",
    "eager",
)
TRAINING_WORKERS = ("--training.dataloader.num_workers", "2")
FLOAT8 = ("--model.converters", "float8")
# MXFP8 numerics with high-precision matmuls: runs on any device.
MX = ("--model.converters", "mx", "--quantize.linear.mx.recipe_name", "mxfp8_emulated")
# A trace of the last step of every 3 (no warmup), over 3 steps: the next cycle starts after training ends.
PROFILING = (
    "--profiling.enable_profiling",
    "--profiling.profile_freq",
    "3",
    "--profiling.profiler_warmup",
    "0",
    "--training.steps",
    "3",
)
PP2 = ("--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4")  # 4 microbatches
CP2 = ("--parallelism.context_parallel_degree", "2")
TP2 = ("--parallelism.tensor_parallel_degree", "2")
EP2 = ("--parallelism.expert_parallel_degree", "2")
# The MoE probes observe where experts are placed and what balancing logs, not the size: a cut of qwen3
# debugmodel_moe (2 layers of 8 experts at dim 64) instead of its 300M parameters, which took a minute a probe.
register_flavor(
    "qwen3",
    "probe_moe",
    replace(
        QWEN3_FLAVORS["debugmodel_moe"],
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        moe_inter_dim=64,
        moe_args=qwen3_moe_args(8, 2),
    ),
)
MOE = ("--model.name", "qwen3", "--model.flavor", "probe_moe")
# DeepSeek-V3 cut alike (a dense then an MoE layer of 8 experts, latent attention at dim 64): what multi-token
# prediction's settings change is the logged loss.
register_flavor(
    "deepseek_v3",
    "probe_mtp",
    replace(
        DEEPSEEK_V3_FLAVORS["debugmodel"],
        dim=64,
        inter_dim=128,
        moe_inter_dim=32,
        n_layers=2,
        n_heads=4,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
    ),
)
MTP = ("--model.name", "deepseek_v3", "--model.flavor", "probe_mtp")
LORA = ("--model.converters", "lora")
MUON = ("--optimizer.name", "Muon")
FT_ONE = ("--fault_tolerance.enable", "--fault_tolerance.group_size", "1")
FT_TWO = ("--fault_tolerance.enable", "--fault_tolerance.group_size", "2")
DILOCO = ("--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", "2")


@dataclass(frozen=True)
class Probe:
    change: tuple[str, ...]
    observe: Callable[[Seen], Any] | None = None  # None: the change is refused
    refusal: str = ""  # for a refused change: what its one line says (a regex)
    base: tuple[str, ...] = ()
    world: int = 1  # > 1: rank 0 of a fake process group of this size
    train: bool = False  # train `training.steps` steps before observing (else stop once built)
    prepare: Callable[[Path], None] | None = None  # writes what the launch reads into its root
    may_stop: bool = False  # the change may stop the run at start (a layout that no longer fits): observed


def refused(change: tuple[str, ...], refusal: str, **kwargs) -> Probe:
    return Probe(change, None, refusal, **kwargs)


# What to look at. Each returns something comparable between two launches. Most only read, so every such
# observer of one launch looks at it once it is made (`_launch`); one that changes what it looks at (reads
# a loader, runs backward, feeds a monitor) is marked `alters` and gets a launch of its own.


def alters(observe: Callable[[Seen], Any]) -> Callable[[Seen], Any]:
    observe.alters = True
    return observe


def options(path: str) -> Callable[[Seen], Any]:
    """The ParallelOptions setting at `path` ("group.field") that the trainer built."""
    group, field = path.split(".")
    return lambda s: s.outcome or getattr(getattr(s.trainer.parallel_options, group), field)


def degrees(s: Seen) -> Any:
    return s.outcome or s.trainer.dims.degrees


def tensor_split(s: Seen) -> Any:
    """The degrees, and how the first block's query projection is held: tp shards its rows."""
    if s.outcome:
        return s.outcome
    weight = s.trainer.model_parts[0].layers["0"].attention.wq.weight
    held = (
        (str(weight.placements), tuple(weight.to_local().shape)) if isinstance(weight, DTensor) else "plain"
    )
    return s.trainer.dims.degrees, held


def spike_reported(losses: list[float]) -> Callable[[Seen], Any]:
    """Whether the run's loss-spike monitor reports the last of `losses` after the others."""

    def observe(s: Seen) -> Any:
        numerics = s.trainer.guard.numerics
        reports: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = reports.append
        logging.getLogger(numerics_module.__name__).addHandler(handler)
        try:
            for step, loss in enumerate(losses, start=1000):
                numerics.observe(step, loss)
        finally:
            logging.getLogger(numerics_module.__name__).removeHandler(handler)
        return [r.getMessage() for r in reports]

    return alters(observe)


def group(key: str) -> Callable[[Seen], Any]:
    return lambda s: s.trainer.optimizers.optimizers[0].param_groups[0][key]


def lr_curve(s: Seen) -> list[float]:
    return [round(s.trainer.optimizers.schedules[0].lr_lambdas[0](k), 6) for k in range(16)]


@alters
def first_batch(s: Seen) -> Any:
    with contextlib.chdir(s.root):  # where relative dataset paths point
        return s.outcome or next(iter(s.trainer.loader))[0].tolist()


def first_validation_batch(s: Seen) -> Any:
    """The first batch of a validation loader built as the trainer builds one."""
    from titan_train.wiring.data import build_validation_loader

    with contextlib.chdir(s.root):
        if s.outcome:
            return s.outcome
        loader = build_validation_loader(s.trainer.config, s.trainer.tokenizer, 0, 1)
        return next(iter(loader))[0].tolist()


def planned_steps(s: Seen) -> Any:
    return s.outcome or s.trainer.plan.steps


def _first_batches(loader, passes: int) -> None:
    for _ in range(passes):
        batches = iter(loader)
        next(batches)
        batches.close()  # the pass ends: workers that do not persist shut down


def training_workers(passes: int) -> Callable[[Seen], Any]:
    """Worker processes the training loader starts (and windows it asks them for) over `passes` passes."""
    return alters(lambda s: s.outcome or worker_counts(s, lambda: _first_batches(s.trainer.loader, passes)))


def validation_workers(validations: int) -> Callable[[Seen], Any]:
    """The same over `validations` validations, each as the trainer runs it."""
    return alters(
        lambda s: (
            s.outcome
            or worker_counts(
                s, lambda: [s.trainer.validator.validate(s.trainer.model_parts) for _ in range(validations)]
            )
        )
    )


def metrics(s: Seen) -> list[dict]:
    return s.jsonl("metrics.jsonl")


def validation(s: Seen) -> list[dict]:
    return s.jsonl("validation.jsonl")


def status_and_metrics(s: Seen) -> Any:
    return s.status, metrics(s)


def flight_recorder_env(s: Seen) -> dict:
    return s.at_build["env"]


def full_collections(s: Seen) -> int:
    return s.collections


def base_storage(s: Seen) -> Any:
    """How the first block's query weight is stored: its type, and NF4's block sizes where it is NF4."""
    if s.outcome:
        return s.outcome
    weight = s.trainer.model_parts[0].layers["0"].attention.wq.weight
    return (
        type(weight).__name__,
        getattr(weight, "block_size", None),
        getattr(weight, "scaler_block_size", None),
    )


def files(s: Seen) -> list[str]:
    """The run's files by path, a TensorBoard event file by its folder alone: its name holds the time and the pid,
    which made every run's files differ from every other's and the probes that compare them pass vacuously."""
    return [
        re.sub(r"events\.out\.tfevents\.[^/]*$", "events.out.tfevents", f)
        for f in s.files()
        if not f.endswith("config.json")
    ]


def logged(needle: str) -> Callable[[Seen], bool]:
    return lambda s: s.log(needle)


pinning = logged("dataloader.pin_memory: no accelerator here")  # on CPU it says there is nothing to pin


def memory_estimate(s: Seen) -> list[str]:
    """What the memory estimate said: how it traced (fake or real tensors, in a child process) and found."""
    return [line for line in s.lines if line.startswith("memory estimate")]


def blocks(s: Seen) -> list[str]:
    return [type(b.forward).__name__ for b in s.trainer.model_parts[0].layers.values()]


def profiled(s: Seen) -> Any:
    """Per trace file the run wrote, the steps it recorded; and what the profiler did in each step."""
    traces = {
        str(f.relative_to(s.dump)): sorted(
            e["name"]
            for e in json.loads(f.read_text())["traceEvents"]
            if e.get("name", "").startswith("ProfilerStep#")
        )
        for f in sorted(s.dump.rglob("*_trace.json"))
    }
    return traces, s.profiler_steps


def model_output(s: Seen) -> Any:
    """Logits summed over the first 3 entries at each position of 8 tokens with an end of document at the
    fifth: the rotary table, the attention mask and the weights all show in them."""
    if s.outcome:
        return s.outcome
    tokens = torch.tensor([[5, 6, 7, 8, s.trainer.tokenizer.eos_id, 9, 10, 11]])
    with torch.no_grad():
        logits = s.trainer.model_parts[0](tokens)
    return [round(float(v), 4) for v in logits[0, :, :3].sum(-1)]


def loss_saved_bytes(s: Seen) -> int:
    """Bytes the run's loss function keeps for backward over bfloat16 logits of 2 x 32 tokens: the chunked
    loss keeps the logits and a float per token, the plain one their float32 log-softmax."""
    logits = torch.randn(2, 32, 2048, dtype=torch.bfloat16, requires_grad=True)
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        s.trainer.loss_fn(logits, torch.randint(0, 2048, (2, 32)))
    return sum(saved)


def held_gradients(s: Seen) -> int:
    """Parameters still holding a gradient after the step."""
    return sum(p.grad is not None for p in s.trainer.model_parts[0].parameters())


def experts_split(s: Seen) -> Any:
    """The first MoE layer's experts weight w1: its mesh dims and placements (plain tensor: None)."""
    if s.outcome:
        return s.outcome
    w1 = next(iter(s.trainer.model_parts[0].moe_layers().values())).experts.w1
    return (w1.device_mesh.mesh_dim_names, w1.placements) if hasattr(w1, "device_mesh") else None


def pipeline(s: Seen) -> Any:
    """The schedule rank 0 built, its microbatches, and the stages it holds (as it logs them)."""
    if s.outcome:
        return s.outcome
    schedule = s.trainer.pipeline.schedule
    held = [line for line in s.lines if line.startswith("pipeline rank 0 holds stage")]
    return type(schedule).__name__, schedule._n_microbatches, held


def checkpoint_kwargs(key: str) -> Callable[[Seen], Any]:
    return lambda s: [b.forward.kwargs.get(key) for b in s.trainer.model_parts[0].layers.values()]


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten.mm.default
        return func(*args, **(kwargs or {}))


@alters
def backward_matmuls(s: Seen) -> int:
    """Matmuls backward runs: those of the gradients plus those recomputation repeats."""
    loss = s.trainer.model_parts[0](torch.zeros(1, 32, dtype=torch.long)).sum()
    with _CountMatmuls() as counter:
        loss.backward()
    return counter.count


def linear_types(s: Seen) -> Any:
    return s.outcome or {
        n: type(m).__name__
        for n, m in s.trainer.model_parts[0].named_modules()
        if "Linear" in type(m).__name__
    }


def float8_configs(key: str) -> Callable[[Seen], Any]:
    return lambda s: {
        getattr(m.config, key) for m in s.trainer.model_parts[0].modules() if hasattr(m, "config")
    }


def mx_settings(key: str) -> Callable[[Seen], Any]:
    def seen(s: Seen) -> Any:
        modules = s.trainer.model_parts[0].modules()
        return s.outcome or {str(getattr(m, key)) for m in modules if type(m).__name__ == "MXLinear"}

    return seen


def precomputed_scales(s: Seen) -> Any:
    """Float8 weights whose scale for the next float8 all-gather was computed after the step."""
    return s.outcome or sum(
        getattr(m.weight._local_tensor, "_precomputed_scale", None) is not None
        for m in s.trainer.model_parts[0].modules()
        if type(m).__name__ == "Float8Linear"
    )


def first_weights(s: Seen) -> float:
    return round(float(next(s.trainer.model_parts[0].parameters()).detach().double().sum()), 6)


def trained_weights(s: Seen) -> float:
    """Every weight summed once training has ended."""
    return round(float(sum(p.detach().double().sum() for p in s.trainer.model_parts[0].parameters())), 6)


def fsdp_state(s: Seen) -> Any:
    """How FSDP holds the first block: offload policy, gradient reduction dtype, resharded after forward."""
    state = s.trainer.model_parts[0].layers["0"]._get_fsdp_state()._fsdp_param_group
    return (
        type(state.offload_policy).__name__,
        str(state.fsdp_params[0].mp_policy.reduce_dtype),
        state.post_forward_mesh_info is None,
    )


def grad_norm_after_clipping(s: Seen) -> float:
    grads = [p.grad for p in s.trainer.model_parts[0].parameters() if p.grad is not None]
    return round(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))), 6)


def saved_dtypes(s: Seen) -> dict[str, list[str]]:
    """Per DCP folder the run wrote: the dtypes of the tensors in it."""
    found = {}
    for marker in sorted(s.dump.rglob(".metadata")):
        meta = FileSystemReader(str(marker.parent)).read_metadata().state_dict_metadata
        dtypes = {
            str(m.properties.dtype)
            for m in meta.values()
            if hasattr(m, "properties") and hasattr(m.properties, "dtype")
        }
        found[str(marker.parent.relative_to(s.dump))] = sorted(dtypes)
    return found


def optimizer_state(s: Seen) -> int:
    return len(s.trainer.optimizers.optimizers[0].state)


def custom_module(s: Seen) -> bool:
    return "probe_extension" in s.at_build["modules"]


def preemption_signals(s: Seen) -> list[int]:
    return [int(sig) for sig in s.trainer.guard.signals.signals]


# Files some launches read: written into the launch's root by `prepare`.


def _docs(path: Path, seed: int) -> None:
    """40 documents of 60 words: JSON lines with a 'text' field, or plain lines for a .txt file."""
    words = ["river", "stone", "light", "paper", "garden", "signal", "winter", "orbit", "copper", "meadow"]
    g = torch.Generator().manual_seed(seed)
    lines = [" ".join(words[i] for i in torch.randint(0, 10, (60,), generator=g).tolist()) for _ in range(40)]
    as_json = path.suffix == ".jsonl"
    path.write_text("".join((json.dumps({"text": line}) if as_json else line) + "\n" for line in lines))


def data_files(root: Path) -> None:
    _docs(root / "docs.jsonl", 0)
    _docs(root / "docs2.jsonl", 1)
    (root / "corpus").mkdir()
    _docs(root / "corpus" / "docs.jsonl", 0)
    _docs(root / "corpus" / "docs.txt", 1)
    (root / "job.toml").write_text("[optimizer]\nlr = 0.123\n")
    (root / "probe_extension.py").write_text(
        "from dataclasses import dataclass, field\n\n@dataclass\nclass Extra:\n    knob: int = 1\n\n"
        "@dataclass\nclass JobConfig:\n    extra: Extra = field(default_factory=Extra)\n"
    )


def split_files(root: Path) -> None:
    """data_files, and `splits/`: a `DatasetDict.save_to_disk` folder whose train and test splits differ."""
    import datasets

    data_files(root)
    texts = [json.loads(line)["text"] for line in (root / "docs.jsonl").read_text().splitlines()]
    others = [json.loads(line)["text"] for line in (root / "docs2.jsonl").read_text().splitlines()]
    splits = {"train": texts, "test": others}
    datasets.DatasetDict(
        {k: datasets.Dataset.from_dict({"text": v}) for k, v in splits.items()}
    ).save_to_disk(root / "splits")


def chat_files(root: Path) -> None:
    """Chat rows holding every layout at once (so the [sft] fields choose what is read), the first one
    longer than 64 tokens; a file with a bad row; another chat template."""
    turns = [
        {"role": "system", "content": "Be brief. " + "river stone light " * 8},
        {"role": "user", "content": "What is one plus two?"},
        {"role": "assistant", "content": "One plus two is three."},
        {"role": "user", "content": "And two plus two?"},
        {"role": "assistant", "content": "Two plus two is four."},
    ]
    row = {
        "messages": turns,
        "conv": turns[1:3],
        "prompt": "Say hello.",
        "completion": "Hello.",
        "q": "Say no.",
        "a": "No.",
    }
    short = {**row, "messages": turns[1:3]}
    lines = [json.dumps(r) + "\n" for r in (row, short, short, row)]
    (root / "chat.jsonl").write_text("".join(lines))
    (root / "chat_bad.jsonl").write_text(
        lines[1] + json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n" + lines[1]
    )
    (root / "other_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}{% endfor %}"
    )


@alters
def preference_files(root: Path) -> None:
    """Four conversational preference pairs (prompt, chosen, rejected)."""
    rows = [
        {
            "prompt": [{"role": "user", "content": f"What is {a} plus {b}?"}],
            "chosen": [{"role": "assistant", "content": f"It is {a + b}."}],
            "rejected": [{"role": "assistant", "content": f"Maybe {a * b + 1}, or not."}],
        }
        for a, b in ((1, 2), (2, 2), (3, 4), (5, 1))
    ]
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def prompt_files(root: Path) -> None:
    """Six conversational prompts (two longer than 40 tokens once rendered), two reward functions of
    continuous value, and rollouts recorded for steps 1 and 2 (three ids per completion)."""
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} plus {b}?" + " Think." * c}],
             "question": f"Add {a} and {b}."} for a, b, c in
            ((1, 2, 0), (2, 2, 9), (3, 4, 0), (5, 1, 12), (6, 1, 1), (2, 7, 2))]  # fmt: skip
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _gsm8k_repository(root / "gsm8k")
    (root / "probe_rewards.py").write_text(
        "def length(completion_ids, **_):\n    return [len(c) / 8 for c in completion_ids]\n\n"
        "def vowels(completions, **_):\n"
        "    return [sum(ch in 'aeiou' for ch in c[0]['content']) / 10 for c in completions]\n"
    )
    lines = [
        {"step": step, "prompt_index": i, "completion_ids": [5 + i, 6 + step + k, 7]}
        for step in (1, 2) for i in range(len(rows)) for k in range(2)
    ]  # fmt: skip
    (root / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def _gsm8k_repository(root: Path) -> None:
    """A dataset repository laid out as openai/gsm8k is on the Hub: configurations main (the default) and
    socratic named in the README, each with a train parquet file of `question` and `answer` columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    readme = ["---", "configs:"]
    for config in ("main", "socratic"):
        readme += [f"- config_name: {config}", *["  default: true"] * (config == "main"), "  data_files:"]
        readme += ["  - split: train", f"    path: {config}/train-*"]
        (root / config).mkdir(parents=True)
        rows = [{"question": f"{config}: what is {a} plus 1?", "answer": f"#### {a + 1}"} for a in range(6)]
        pq.write_table(pa.Table.from_pylist(rows), root / config / "train-00000-of-00001.parquet")
    (root / "README.md").write_text("\n".join([*readme, "---", ""]))


def grpo_loss(s: Seen) -> Any:
    """The loss settings the GRPO objective holds (titan_train.objectives.grpo_loss.GRPOLoss, whose effect
    test_grpo_loss_trl checks against TRL): on-policy, the ratio is 1, so clipping ranges and the sequence
    level do not change a step."""
    return s.outcome or s.trainer.objective.loss


def chat_batch(s: Seen) -> Any:
    """The first batch of chat rows: inputs, labels and positions."""
    with contextlib.chdir(s.root):
        return s.outcome or [t.tolist() for t in next(iter(s.trainer.loader))]


def schedule_csv(root: Path) -> None:
    """A 1F1B-like schedule of 4 microbatches over 2 single-stage ranks, as torch's runtime schedule reads it."""
    (root / "schedule.csv").write_text("0F0,0F1,0F2,0F3,0B0,0B1,0B2,0B3\n1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3\n")


def saved_run(root: Path) -> None:
    """A finished 2-step run's checkpoints (full state at steps 1 and 2), copied into `out/checkpoint`."""
    data_files(root)
    shutil.copytree(SAVED, root / "out" / "checkpoint")


SAVED: Path  # set by the `saved` fixture


PROBES: dict[str, Probe] = {
    # [job]
    "job.config_file": Probe(("--job.config_file", "job.toml"), group("lr"), prepare=data_files),
    "job.dump_folder": Probe(("--job.dump_folder", "elsewhere"), files),
    "job.description": Probe(  # names the Weights & Biases run (and titles `titan-train report`)
        ("--job.description", "probe run"),
        lambda s: s.trainer.metrics.wandb.name,
        base=("--metrics.enable_wandb",),
        train=True,
    ),
    "job.print_config": Probe(("--job.print_config",), logged("configuration:")),
    "job.save_config_file": Probe(("--job.save_config_file", "saved.json"), files),
    "job.custom_config_module": Probe(
        ("--job.custom_config_module", "probe_extension"),
        lambda s: hasattr(s.trainer.config, "extra"),
        prepare=data_files,
    ),
    # [profiling]
    "profiling.enable_profiling": Probe(
        ("--profiling.enable_profiling",), profiled, base=PROFILING[1:], train=True
    ),
    "profiling.save_traces_folder": Probe(
        ("--profiling.save_traces_folder", "traces"), profiled, base=PROFILING, train=True
    ),
    "profiling.profile_freq": Probe(("--profiling.profile_freq", "1"), profiled, base=PROFILING, train=True),
    "profiling.profiler_active": Probe(
        ("--profiling.profiler_active", "2"), profiled, base=PROFILING, train=True
    ),
    "profiling.profiler_warmup": Probe(
        ("--profiling.profiler_warmup", "1"), profiled, base=PROFILING, train=True
    ),
    "profiling.enable_memory_snapshot": refused(
        ("--profiling.enable_memory_snapshot",), "memory snapshots record the CUDA caching allocator"
    ),
    "profiling.save_memory_snapshot_folder": refused(
        ("--profiling.enable_memory_snapshot", "--profiling.save_memory_snapshot_folder", "snaps"),
        "memory snapshots record the CUDA",
    ),
    # [metrics]
    "metrics.log_freq": Probe(("--metrics.log_freq", "3"), metrics, train=True),  # step 1 only, not 1 and 2
    "metrics.enable_tensorboard": Probe(("--metrics.enable_tensorboard",), files),
    "metrics.disable_color_printing": Probe(
        ("--metrics.no_disable_color_printing",),
        lambda s: any("\x1b[" in line for line in s.lines),
        train=True,
    ),
    "metrics.save_tb_folder": Probe(
        ("--metrics.save_tb_folder", "board"), files, base=("--metrics.enable_tensorboard",)
    ),
    "metrics.save_for_all_ranks": Probe(
        ("--metrics.save_for_all_ranks",), files, base=("--metrics.enable_tensorboard",)
    ),
    "metrics.enable_wandb": Probe(("--metrics.enable_wandb",), files, train=True),
    # [model]
    "model.name": Probe(("--model.name", "llama2"), model_output),  # llama2's rotary base and no stretch
    "model.flavor": Probe(  # block-causal flex attention: positions after the end of document change
        ("--model.flavor", "debugmodel_flex_attn"), model_output
    ),
    "model.hf_assets_path": Probe(
        ("--model.hf_assets_path", str(ASSETS / "tokenizer_llama2")), first_batch
    ),  # the same text, other tokens
    "model.converters": Probe(FLOAT8, linear_types),
    "model.print_after_conversion": Probe(("--model.print_after_conversion",), logged("model:\n")),
    # [optimizer]
    "optimizer.name": Probe(
        ("--optimizer.name", "Adam"), lambda s: type(s.trainer.optimizers.optimizers[0]).__name__
    ),
    "optimizer.lr": Probe(("--optimizer.lr", "0.5"), group("initial_lr")),
    "optimizer.beta1": Probe(("--optimizer.beta1", "0.5"), group("betas")),
    "optimizer.beta2": Probe(("--optimizer.beta2", "0.5"), group("betas")),
    "optimizer.eps": Probe(("--optimizer.eps", "0.5"), group("eps")),
    "optimizer.weight_decay": Probe(("--optimizer.weight_decay", "0.5"), group("weight_decay")),
    "optimizer.implementation": Probe(
        ("--optimizer.implementation", "foreach"), lambda s: (group("fused")(s), group("foreach")(s))
    ),
    # [optimizer.muon]: each setting reaches the Muon group (the blocks' matrices, param_groups[0])
    **{
        f"optimizer.muon.{key}": Probe((f"--optimizer.muon.{key}", value), group(key), base=MUON)
        for key, value in (
            ("lr", "0.5"),
            ("weight_decay", "0.5"),
            ("momentum", "0.5"),
            ("ns_steps", "3"),
            ("ns_coefficients", "3,-4,2"),
            ("ns_dtype", "float32"),  # the dtype's effect on a step: test_muon.py
            ("eps", "0.5"),
            ("adjust_lr_fn", "match_rms_adamw"),
        )
    },
    "optimizer.muon.nesterov": Probe(("--optimizer.muon.no_nesterov",), group("nesterov"), base=MUON),
    "optimizer.muon.qk_clip_tau": Probe(  # a tau every head exceeds: the first step clips and says so
        ("--optimizer.muon.qk_clip_tau", "1e-6"),
        lambda s: s.log("qk-clip: step 1:"),
        base=(*MUON, "--optimizer.muon.ns_dtype", "float32", "--training.steps", "1"),
        train=True,
    ),
    "optimizer.early_step_in_backward": Probe(  # each gradient is freed once its parameter stepped
        ("--optimizer.early_step_in_backward",), held_gradients, base=("--training.steps", "1"), train=True
    ),
    # [lr_scheduler]
    "lr_scheduler.warmup_steps": Probe(
        ("--lr_scheduler.warmup_steps", "4"), lr_curve, base=("--training.steps", "12")
    ),
    "lr_scheduler.total_steps": Probe(
        ("--lr_scheduler.total_steps", "16"), lr_curve, base=("--training.steps", "12")
    ),
    "lr_scheduler.decay_ratio": Probe(
        ("--lr_scheduler.decay_ratio", "0.5"), lr_curve, base=("--training.steps", "12")
    ),
    "lr_scheduler.decay_type": Probe(
        ("--lr_scheduler.decay_type", "cosine"), lr_curve, base=("--training.steps", "12")
    ),
    "lr_scheduler.min_lr_factor": Probe(
        ("--lr_scheduler.min_lr_factor", "0.5"), lr_curve, base=("--training.steps", "12")
    ),
    # [training]
    "training.dataset": Probe(  # corpus/ holds a .jsonl and a .txt file: the dataset picks which is read
        ("--training.dataset", "text"),
        first_batch,
        base=("--training.dataset", "json", "--training.dataset_path", "corpus"),
        prepare=data_files,
    ),
    "training.dataset_path": Probe(
        ("--training.dataset_path", "docs2.jsonl"), first_batch, base=JSON_DATA, prepare=data_files
    ),
    # Preference pairs train the preference objective by default; next_token trains their tokens instead.
    "training.objective": Probe(
        ("--training.objective", "next_token"),
        lambda s: type(s.trainer.objective).__name__,
        base=PREFERENCE,
        prepare=preference_files,
    ),
    "training.dataset_split": Probe(
        ("--training.dataset_split", "test"), first_batch, base=SPLITS, prepare=split_files
    ),
    "training.dataset_config": Probe(  # GSM8K's socratic rows instead of its default, main
        ("--training.dataset_config", "socratic"),
        first_batch,
        base=(*PROMPTS, "--training.dataset_path", "gsm8k", "--grpo.prompt_field", "question"),
        prepare=prompt_files,
    ),
    "training.dataset_mixture": Probe(  # from one file mixed with itself to two files
        ("--training.dataset_mixture", "docs.jsonl,docs2.jsonl"),
        first_batch,
        base=(*MIXTURE, "--training.dataset_mixture", "docs.jsonl,docs.jsonl"),
        prepare=data_files,
    ),
    "training.dataset_weights": Probe(
        ("--training.dataset_weights", "0.9,0.1"), first_batch, base=MIXTURE, prepare=data_files
    ),
    "training.epochs": Probe(  # 10000 is training.steps' default: not given, so epochs set the steps
        ("--training.epochs", "3"),
        planned_steps,
        base=(*CHAT, "--training.steps", "10000"),
        prepare=chat_files,
    ),
    "training.local_batch_size": Probe(("--training.local_batch_size", "3"), first_batch),
    "training.global_batch_size": Probe(
        ("--training.global_batch_size", "4"), lambda s: s.trainer.grad_accum_steps
    ),
    "training.seq_len": Probe(("--training.seq_len", "16"), first_batch),
    "training.max_norm": Probe(
        ("--training.max_norm", "0.01"), grad_norm_after_clipping, base=("--training.steps", "1"), train=True
    ),
    "training.steps": Probe(("--training.steps", "3"), metrics, train=True),
    "training.chunked_loss": Probe(("--training.no_chunked_loss",), loss_saved_bytes),
    "training.enable_cpu_offload": Probe(("--training.enable_cpu_offload",), fsdp_state, world=2),
    "training.dtype": Probe(
        ("--training.dtype", "bfloat16"), lambda s: str(next(s.trainer.model_parts[0].parameters()).dtype)
    ),
    "training.mixed_precision_param": Probe(
        ("--training.mixed_precision_param", "float32"), logged("kept as float32 on CPU"), world=2
    ),
    "training.mixed_precision_reduce": refused(
        ("--training.mixed_precision_reduce", "bfloat16"), "mixed_precision_reduce = 'bfloat16' is not one of"
    ),
    "training.gc_freq": Probe(("--training.gc_freq", "1"), full_collections, train=True),
    "training.gc_debug": Probe(("--training.gc_debug",), full_collections, train=True),
    "training.dataloader.num_workers": Probe(("--training.dataloader.num_workers", "2"), training_workers(1)),
    "training.dataloader.persistent_workers": Probe(
        ("--training.dataloader.persistent_workers",), training_workers(2), base=TRAINING_WORKERS
    ),
    "training.dataloader.pin_memory": Probe(("--training.dataloader.pin_memory",), pinning),
    "training.dataloader.prefetch_factor": Probe(
        ("--training.dataloader.prefetch_factor", "4"), training_workers(1), base=TRAINING_WORKERS
    ),
    "training.dataloader.num_streams": Probe(("--training.dataloader.num_streams", "3"), first_batch),
    # [parallelism]: rank 0 of a fake group
    "parallelism.data_parallel_replicate_degree": Probe(
        ("--parallelism.data_parallel_replicate_degree", "2"), degrees, world=4
    ),
    "parallelism.data_parallel_shard_degree": Probe(
        ("--parallelism.data_parallel_shard_degree", "2"), degrees, world=4, may_stop=True
    ),
    "parallelism.fsdp_reshard_after_forward": Probe(
        ("--parallelism.fsdp_reshard_after_forward", "never"), fsdp_state, world=2
    ),
    "parallelism.tensor_parallel_degree": Probe(
        ("--parallelism.tensor_parallel_degree", "2"), tensor_split, world=4
    ),
    "parallelism.disable_loss_parallel": Probe(
        ("--parallelism.disable_loss_parallel",),
        options("tensor_parallel.loss_parallel"),
        base=("--parallelism.tensor_parallel_degree", "2"),
        world=2,
    ),
    "parallelism.enable_async_tensor_parallel": refused(
        ("--parallelism.enable_async_tensor_parallel",),
        "async_tp needs CUDA",
        base=("--parallelism.tensor_parallel_degree", "2"),
        world=2,
    ),
    "parallelism.pipeline_parallel_degree": Probe(
        ("--parallelism.pipeline_parallel_degree", "2"), degrees, world=4
    ),
    "parallelism.module_fqns_per_model_part": Probe(
        (
            "--parallelism.module_fqns_per_model_part",
            "tok_embeddings,layers.0;layers.1,layers.2,layers.3,layers.4,layers.5,norm,output",
        ),
        pipeline,
        base=PP2,
        world=2,
    ),
    "parallelism.pipeline_parallel_first_stage_less_layers": Probe(
        ("--parallelism.pipeline_parallel_first_stage_less_layers", "0"), pipeline, base=PP2, world=2
    ),
    "parallelism.pipeline_parallel_last_stage_less_layers": Probe(  # a V: rank 0 holds the last stage too
        ("--parallelism.pipeline_parallel_last_stage_less_layers", "2"),
        pipeline,
        base=(*PP2, "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"),
        world=2,
    ),
    "parallelism.pipeline_parallel_layers_per_stage": Probe(
        ("--parallelism.pipeline_parallel_layers_per_stage", "1"),
        pipeline,
        base=(*PP2, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"),
        world=2,
    ),
    "parallelism.pipeline_parallel_schedule": Probe(
        ("--parallelism.pipeline_parallel_schedule", "GPipe"), pipeline, base=PP2, world=2
    ),
    "parallelism.pipeline_parallel_schedule_csv": Probe(
        ("--parallelism.pipeline_parallel_schedule_csv", "schedule.csv"),
        pipeline,
        base=PP2,
        world=2,
        prepare=schedule_csv,
    ),
    "parallelism.pipeline_parallel_microbatch_size": Probe(
        ("--parallelism.pipeline_parallel_microbatch_size", "2"), pipeline, base=PP2, world=2
    ),
    # Under DualPipeV, true (torchtitan's overlap, which Titan does not run) is said at start; false is silent.
    "parallelism.pipeline_parallel_expert_parallel_overlap": Probe(
        ("--parallelism.no_pipeline_parallel_expert_parallel_overlap",),
        lambda s: s.log("pipeline_parallel_expert_parallel_overlap = true"),
        base=(*PP2, "--parallelism.pipeline_parallel_schedule", "DualPipeV"),
        world=2,
    ),
    "parallelism.context_parallel_degree": Probe(
        ("--parallelism.context_parallel_degree", "2"), degrees, world=4
    ),
    "parallelism.context_parallel_load_balancer": Probe(
        ("--parallelism.context_parallel_load_balancer", "None"),
        options("context_parallel.load_balance"),
        base=CP2,
        world=2,
    ),
    "parallelism.context_parallel_rotate_method": Probe(
        ("--parallelism.context_parallel_rotate_method", "alltoall"),
        options("context_parallel.rotate_method"),
        base=CP2,
        world=2,
    ),
    "parallelism.expert_parallel_degree": Probe(EP2, experts_split, base=MOE, world=2),
    "parallelism.expert_tensor_parallel_degree": Probe(
        ("--parallelism.expert_tensor_parallel_degree", "2"), experts_split, base=(*MOE, *EP2, *TP2), world=4
    ),
    "parallelism.expert_parallel_comm_backend": refused(
        ("--parallelism.expert_parallel_comm_backend", "deepep", *EP2),
        "DeepEP's all-to-all kernels are not wired",
    ),
    # [checkpoint]: a 2-step run's checkpoints are copied in where a launch loads them
    "checkpoint.enable": Probe(("--checkpoint.enable",), files, train=True),
    "checkpoint.folder": Probe(("--checkpoint.folder", "ckpt"), files, base=CKPT, train=True),
    "checkpoint.interval": Probe(("--checkpoint.interval", "2"), files, base=CKPT, train=True),
    "checkpoint.keep_latest_k": Probe(
        ("--checkpoint.keep_latest_k", "1"),
        files,
        base=(*CKPT, "--checkpoint.no_last_save_model_only"),
        train=True,
    ),
    "checkpoint.load_step": Probe(
        ("--checkpoint.load_step", "1"),
        metrics,
        base=(*CKPT, "--training.steps", "3"),
        train=True,
        prepare=saved_run,
    ),
    "checkpoint.initial_load_path": Probe(
        ("--checkpoint.initial_load_path", "out/checkpoint/step-1"),
        metrics,
        base=("--checkpoint.enable", "--checkpoint.folder", "fresh", "--training.steps", "1"),
        train=True,
        prepare=saved_run,
    ),
    "checkpoint.initial_load_model_only": Probe(
        ("--checkpoint.no_initial_load_model_only",),
        metrics,
        base=(
            "--checkpoint.enable",
            "--checkpoint.folder",
            "fresh",
            "--checkpoint.initial_load_path",
            "out/checkpoint/step-1",
            "--training.steps",
            "3",
        ),
        train=True,
        prepare=saved_run,
    ),
    "checkpoint.initial_load_in_hf": refused(
        ("--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", "out/checkpoint/step-1"),
        "safetensors|config.json|HF",
        base=("--checkpoint.enable", "--checkpoint.folder", "fresh"),
        prepare=saved_run,
    ),
    "checkpoint.initial_load_in_hf_quantized": refused(
        ("--checkpoint.initial_load_in_hf_quantized",),
        "initial_load_in_hf",
        base=("--checkpoint.enable",),
    ),
    "checkpoint.last_save_model_only": Probe(
        ("--checkpoint.no_last_save_model_only",), files, base=CKPT, train=True
    ),
    "checkpoint.last_save_in_hf": Probe(("--checkpoint.last_save_in_hf",), files, base=CKPT, train=True),
    "checkpoint.export_dtype": Probe(
        ("--checkpoint.export_dtype", "bfloat16"), saved_dtypes, base=CKPT, train=True
    ),
    "checkpoint.hf_export_lossy": refused(
        ("--checkpoint.hf_export_lossy",),
        "checkpoint.hf_export_lossy",
        base=(*CKPT, "--checkpoint.last_save_in_hf"),
    ),
    "checkpoint.hf_max_shard_bytes": Probe(
        ("--checkpoint.hf_max_shard_bytes", "100000"),
        files,
        base=(*CKPT, "--checkpoint.last_save_in_hf"),
        train=True,
    ),
    "checkpoint.async_mode": Probe(
        ("--checkpoint.async_mode", "async"),
        lambda s: s.at_build["checkpoint_stager"],
        base=CKPT,
    ),
    "checkpoint.exclude_from_loading": Probe(
        ("--checkpoint.exclude_from_loading", "optimizer"),
        optimizer_state,
        base=CKPT,
        train=True,
        prepare=saved_run,
    ),
    "checkpoint.enable_first_step_checkpoint": Probe(
        ("--checkpoint.enable_first_step_checkpoint",),
        files,
        base=("--checkpoint.enable", "--checkpoint.interval", "10"),
        train=True,
    ),
    "checkpoint.create_seed_checkpoint": Probe(
        ("--checkpoint.create_seed_checkpoint",), files, base=("--checkpoint.enable",), train=True
    ),
    "checkpoint.load_only": Probe(("--checkpoint.load_only",), files, base=CKPT, train=True),
    # [activation_checkpoint]
    "activation_checkpoint.mode": Probe(("--activation_checkpoint.mode", "full"), blocks),
    "activation_checkpoint.selective_ac_option": Probe(
        ("--activation_checkpoint.selective_ac_option", "3"),
        blocks,
        base=("--activation_checkpoint.mode", "selective"),
    ),
    "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns": Probe(
        ("--activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns", "feed_forward.w2"),
        backward_matmuls,
        base=(
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective_ac_option",
            "op",
        ),
    ),
    "activation_checkpoint.early_stop": Probe(
        ("--activation_checkpoint.early_stop",),
        checkpoint_kwargs("early_stop"),
        base=("--activation_checkpoint.mode", "full"),
    ),
    # The budget reaches titan-parallel's options; test_memory_budget.py shows the compiled graphs save less.
    "activation_checkpoint.memory_budget": Probe(
        ("--activation_checkpoint.memory_budget", "0.3"),
        lambda s: s.trainer.parallel_options.activation_checkpoint.memory_budget,
        base=MEMORY_BUDGET,
    ),
    "activation_checkpoint.visualize_memory_budget_pareto": Probe(
        ("--activation_checkpoint.visualize_memory_budget_pareto",),
        lambda s: s.trainer.parallel_options.activation_checkpoint.pareto_dir,
        base=MEMORY_BUDGET,
    ),
    "activation_checkpoint.preserve_rng_state": Probe(
        ("--activation_checkpoint.preserve_rng_state",),
        checkpoint_kwargs("preserve_rng_state"),
        base=("--activation_checkpoint.mode", "full"),
    ),
    "activation_checkpoint.determinism_check": Probe(
        ("--activation_checkpoint.determinism_check", "none"),
        checkpoint_kwargs("determinism_check"),
        base=("--activation_checkpoint.mode", "full"),
    ),
    "activation_checkpoint.debug": Probe(
        ("--activation_checkpoint.debug",),
        checkpoint_kwargs("debug"),
        base=("--activation_checkpoint.mode", "full"),
    ),
    # [compile]: built, not run (a compile on this CPU takes seconds per graph)
    "compile.enable": Probe(
        ("--compile.enable",),
        lambda s: [b._compiled_call_impl is not None for b in s.trainer.model_parts[0].layers.values()],
        base=("--compile.backend", "eager"),
    ),
    "compile.components": Probe(
        ("--compile.components", "loss"),
        lambda s: (
            [b._compiled_call_impl is not None for b in s.trainer.model_parts[0].layers.values()],
            hasattr(s.trainer.loss_fn, "_torchdynamo_orig_callable"),
        ),
        base=("--compile.enable", "--compile.backend", "eager"),
    ),
    "compile.backend": Probe(
        ("--compile.backend", "aot_eager"),
        options("compile.backend"),
        base=("--compile.enable", "--compile.backend", "eager"),
    ),
    # [quantize]
    "quantize.linear.float8.enable_fsdp_float8_all_gather": Probe(
        ("--quantize.linear.float8.enable_fsdp_float8_all_gather",),
        float8_configs("enable_fsdp_float8_all_gather"),
        base=FLOAT8,
        world=2,
    ),
    "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp": Probe(
        ("--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",),
        precomputed_scales,
        # emulate: float8 matmuls done in float32 on the same scaled values (with torch's CPU float8 matmul this
        # probe took 58 s, emulated 3.6 s); the scales are the same
        base=(
            *FLOAT8,
            "--quantize.linear.float8.emulate",
            "--quantize.linear.float8.enable_fsdp_float8_all_gather",
            "--training.steps",
            "1",
        ),
        world=2,
        train=True,
    ),
    "quantize.linear.float8.recipe_name": Probe(
        ("--quantize.linear.float8.recipe_name", "rowwise"),
        float8_configs("cast_config_weight"),  # scaled per tensor or per row
        base=FLOAT8,
    ),
    "quantize.linear.float8.filter_fqns": Probe(
        ("--quantize.linear.float8.filter_fqns", "layers.0.feed_forward"), linear_types, base=FLOAT8
    ),
    "quantize.linear.float8.emulate": Probe(
        ("--quantize.linear.float8.emulate",), float8_configs("emulate"), base=FLOAT8
    ),
    "quantize.linear.mx.mxfp8_dim1_cast_kernel_choice": Probe(
        ("--quantize.linear.mx.mxfp8_dim1_cast_kernel_choice", "torch"),
        mx_settings("dim1_cast_kernel"),
        base=MX,
    ),
    "quantize.linear.mx.recipe_name": Probe(
        ("--quantize.linear.mx.recipe_name", "mxfp8_emulated_rceil"),
        mx_settings("scale_calculation_mode"),  # a block's power-of-two scale rounded down or up
        base=MX,
    ),
    "quantize.linear.mx.filter_fqns": Probe(
        ("--quantize.linear.mx.filter_fqns", "output,layers.0"), linear_types, base=MX
    ),
    # Inert unless their converter is in model.converters (as torchtitan reads them), and that is refused.
    "quantize.grouped_mm.float8.fqns": refused(
        ("--model.converters", "quantize.grouped_mm.float8", "--quantize.grouped_mm.float8.fqns", "experts"),
        "quantize.grouped_mm.float8",
    ),
    "quantize.grouped_mm.mx.recipe_name": refused(
        (
            "--model.converters",
            "quantize.grouped_mm.mx",
            "--quantize.grouped_mm.mx.fqns",
            "experts",
            "--quantize.grouped_mm.mx.recipe_name",
            "mxfp8_wgrad_with_hp",
        ),
        "quantize.grouped_mm.mx",
    ),
    "quantize.grouped_mm.mx.fqns": refused(
        ("--model.converters", "quantize.grouped_mm.mx", "--quantize.grouped_mm.mx.fqns", "experts"),
        "quantize.grouped_mm.mx",
    ),
    # [comm]
    "comm.init_timeout_seconds": Probe(
        ("--comm.init_timeout_seconds", "77"), lambda s: s.at_build["timeout"]
    ),
    "comm.train_timeout_seconds": Probe(
        ("--comm.train_timeout_seconds", "33"), lambda s: s.at_train["timeout"]
    ),
    "comm.trace_buf_size": Probe(("--comm.trace_buf_size", "0"), flight_recorder_env),
    "comm.save_traces_folder": Probe(("--comm.save_traces_folder", "traces"), flight_recorder_env),
    "comm.save_traces_file_prefix": Probe(("--comm.save_traces_file_prefix", "r"), flight_recorder_env),
    "comm.mode": Probe(
        ("--comm.mode", "fake_backend"), lambda s: (s.status, s.trainer is None, s.log("dry run:"))
    ),
    # [memory_estimation]
    "memory_estimation.enable": Probe(("--memory_estimation.enable",), memory_estimate),
    "memory_estimation.disable_fake_mode": Probe(
        ("--memory_estimation.disable_fake_mode",), memory_estimate, base=("--memory_estimation.enable",)
    ),
    # [fault_tolerance]: torchft's Manager for a group of one rank, its lighthouse started by `launch`
    "fault_tolerance.enable": Probe(FT_ONE, logged("started its torchft manager")),
    "fault_tolerance.process_group": refused(
        ("--fault_tolerance.process_group", "nccl"), "NCCL needs CUDA", base=FT_ONE
    ),
    "fault_tolerance.process_group_timeout_ms": Probe(
        ("--fault_tolerance.process_group_timeout_ms", "5000"),
        lambda s: s.trainer.replicas.manager._pg._timeout,
        base=FT_ONE,
    ),
    "fault_tolerance.replica_id": Probe(("--fault_tolerance.replica_id", "1"), first_batch, base=FT_TWO),
    # The groups deal the data as one larger data-parallel dimension: the loader's share of it.
    "fault_tolerance.group_size": Probe(
        ("--fault_tolerance.group_size", "2"), lambda s: (s.trainer.dp_rank, s.trainer.dp_degree), base=FT_ONE
    ),
    "fault_tolerance.min_replica_size": Probe(
        ("--fault_tolerance.min_replica_size", "2"),
        lambda s: s.trainer.replicas.manager._min_replica_size,
        base=FT_TWO,
    ),
    # Semi-synchronous training on a group of one: DiLoCo's outer step (and its schedule) moves the weights.
    "fault_tolerance.semi_sync_method": Probe(DILOCO, trained_weights, base=FT_ONE, train=True),
    "fault_tolerance.sync_steps": Probe(
        ("--fault_tolerance.sync_steps", "1"), trained_weights, base=(*FT_ONE, *DILOCO), train=True
    ),
    "fault_tolerance.should_quantize": refused(
        ("--fault_tolerance.should_quantize",), "Triton kernels on CUDA only", base=(*FT_ONE, *DILOCO)
    ),
    **{
        f"fault_tolerance.{name}": Probe(
            (f"--fault_tolerance.{name}", value), trained_weights, base=(*FT_ONE, *DILOCO), train=True
        )
        for name, value in (
            ("fragment_sync_delay", "1"),
            ("fragment_update_alpha", "0.5"),
            (
                "module_fqns_per_model_fragment",
                "tok_embeddings,layers.0,layers.1,layers.2;layers.3,layers.4,layers.5,norm,output",
            ),
            ("num_fragments", "2"),
        )
    },
    # [experimental]
    "experimental.custom_import": Probe(
        ("--experimental.custom_import", "probe_extension"), custom_module, prepare=data_files
    ),
    # [validation]
    "validation.enable": Probe(
        (
            "--validation.enable",
            "--validation.seq_len",
            "32",
            "--validation.steps",
            "1",
            "--validation.freq",
            "1",
            "--validation.dataset",
            "c4_test",
        ),
        validation,
        train=True,
    ),
    "validation.dataset": Probe(
        ("--validation.dataset", "json", "--validation.dataset_path", "docs.jsonl"),
        validation,
        base=VALIDATION,
        train=True,
        prepare=data_files,
    ),
    "validation.dataset_path": Probe(
        ("--validation.dataset_path", "docs2.jsonl"),
        validation,
        base=(*VALIDATION, "--validation.dataset", "json", "--validation.dataset_path", "docs.jsonl"),
        train=True,
        prepare=data_files,
    ),
    "validation.dataset_split": Probe(
        ("--validation.dataset_split", "test"),
        first_validation_batch,
        base=(*VALIDATION, "--validation.dataset", "json", "--validation.dataset_path", "splits"),
        prepare=split_files,
    ),
    "validation.holdout_share": Probe(  # the training rows lose the held-out half
        ("--validation.holdout_share", "0.5"), first_batch, base=(*VALIDATION, *JSON_DATA), prepare=data_files
    ),
    "validation.local_batch_size": Probe(
        ("--validation.local_batch_size", "3"), validation, base=VALIDATION, train=True
    ),
    "validation.seq_len": Probe(("--validation.seq_len", "16"), validation, base=VALIDATION, train=True),
    "validation.freq": Probe(("--validation.freq", "2"), validation, base=VALIDATION, train=True),
    "validation.steps": Probe(("--validation.steps", "2"), validation, base=VALIDATION, train=True),
    "validation.dataloader.num_workers": Probe(
        ("--validation.dataloader.num_workers", "2"), validation_workers(1), base=VALIDATION
    ),
    "validation.dataloader.persistent_workers": refused(  # each validation reads a fresh loader
        ("--validation.dataloader.num_workers", "2", "--validation.dataloader.persistent_workers"),
        "validation.dataloader.persistent_workers = true: each validation reads a fresh loader",
        base=VALIDATION,
    ),
    "validation.dataloader.pin_memory": Probe(  # the validation loader is built when it validates
        ("--validation.dataloader.pin_memory",), pinning, base=VALIDATION, train=True
    ),
    "validation.dataloader.prefetch_factor": Probe(
        ("--validation.dataloader.prefetch_factor", "4"),
        validation_workers(1),
        base=(*VALIDATION, "--validation.dataloader.num_workers", "2"),
    ),
    "validation.dataloader.num_streams": Probe(
        ("--validation.dataloader.num_streams", "3"), validation, base=VALIDATION, train=True
    ),
    # [debug]
    "debug.seed": Probe(("--debug.seed", "7"), first_weights),
    "debug.deterministic": Probe(("--debug.deterministic",), lambda s: s.at_build["deterministic"]),
    "debug.deterministic_warn_only": Probe(
        ("--debug.deterministic_warn_only",),
        lambda s: s.at_build["warn_only"],
        base=("--debug.deterministic",),
    ),
    "debug.moe_force_load_balance": refused(("--debug.moe_force_load_balance",), "no experts"),
    # qwen3's expert bias is frozen by default (as torchtitan's trainer): a step size moves it, and step 2 routes
    # otherwise; the aux loss changes the gradients and shows in the metrics.
    "model.moe_load_balance_coeff": Probe(
        ("--model.moe_load_balance_coeff", "0.1"), metrics, base=MOE, train=True
    ),
    "model.moe_seq_aux_loss_coeff": Probe(
        ("--model.moe_seq_aux_loss_coeff", "0.01"), metrics, base=MOE, train=True
    ),
    "model.num_mtp_layers": Probe(("--model.num_mtp_layers", "1"), metrics, base=MTP, train=True),
    "model.mtp_loss_weight": Probe(
        ("--model.mtp_loss_weight", "0.5"), metrics, base=(*MTP, "--model.num_mtp_layers", "1"), train=True
    ),
    # [health]: a planted NaN loss at step 1 shows what each setting does with it
    # [lora]: what reached titan-parallel's LoRA (its tests prove the adapters act on it)
    "lora.rank": Probe(("--lora.rank", "4"), options("lora.rank"), base=LORA),
    "lora.alpha": Probe(("--lora.alpha", "4"), options("lora.alpha"), base=LORA),
    "lora.dropout": Probe(("--lora.dropout", "0.1"), options("lora.dropout"), base=LORA),
    "lora.target_modules": Probe(("--lora.target_modules", "o_proj"), options("lora.targets"), base=LORA),
    "lora.train_embeddings": Probe(("--lora.train_embeddings",), options("lora.trainable"), base=LORA),
    # step-1 holds the whole model (no frozen_base.json) once adapter-only saves are off
    "lora.save_adapter_only": Probe(
        ("--lora.save_adapter_only", "false"), files, base=(*LORA, *CKPT), train=True
    ),
    # the first block's query weight once training has loaded the base: NF4 (with these blocks) or as it was
    "lora.quantize_base": Probe(("--lora.quantize_base", "nf4"), base_storage, base=LORA, train=True),
    "lora.nf4_scaler_block_size": Probe(
        ("--lora.nf4_scaler_block_size", "8"),
        base_storage,
        base=(*LORA, "--lora.quantize_base", "nf4"),
        train=True,
    ),
    "health.on_nonfinite": Probe(
        ("--health.on_nonfinite", "skip"), status_and_metrics, base=DRILL, train=True
    ),
    "health.max_skipped_steps": Probe(
        ("--health.max_skipped_steps", "0"),
        status_and_metrics,
        base=(*DRILL, "--health.on_nonfinite", "skip"),
        train=True,
    ),
    # Default ratio 2 over 20 steps: a 1.5x loss after 20 steps of 1.0, and a 2.5x one after 3 steps.
    "health.loss_spike_ratio": Probe(
        ("--health.loss_spike_ratio", "1.01"), spike_reported([1.0] * 20 + [1.5])
    ),
    "health.loss_spike_window": Probe(("--health.loss_spike_window", "3"), spike_reported([1.0] * 3 + [2.5])),
    "health.preemption_signals": Probe(("--health.preemption_signals", "SIGUSR2"), preemption_signals),
    "health.drill": Probe(
        ("--health.drill", "nan"),
        status_and_metrics,
        base=("--health.drill_step", "1"),
        train=True,
    ),
    "health.drill_step": Probe(("--health.drill_step", "2"), status_and_metrics, base=DRILL, train=True),
    "health.drill_rank": Probe(
        ("--health.drill_rank", "1"), lambda s: s.status, base=DRILL, world=2, train=True
    ),
    # [sft]
    "preference.loss": Probe(
        ("--preference.loss", "ipo"), metrics, base=PREFERENCE, train=True, prepare=preference_files
    ),
    "preference.beta": Probe(
        ("--preference.beta", "0.5"), metrics, base=PREFERENCE, train=True, prepare=preference_files
    ),
    "preference.label_smoothing": Probe(
        ("--preference.label_smoothing", "0.2"),
        metrics,
        base=PREFERENCE,
        train=True,
        prepare=preference_files,
    ),
    "preference.simpo_gamma": Probe(
        ("--preference.simpo_gamma", "2.0"),
        metrics,
        base=(*PREFERENCE, "--preference.loss", "simpo"),
        train=True,
        prepare=preference_files,
    ),
    "preference.rpo_alpha": Probe(
        ("--preference.rpo_alpha", "1.0"), metrics, base=PREFERENCE, train=True, prepare=preference_files
    ),
    "preference.reference": Probe(
        ("--preference.reference", "precompute"),
        logged("reference log-probs of"),
        base=PREFERENCE,
        train=True,
        prepare=preference_files,
    ),
    "grpo.num_generations": Probe(
        ("--grpo.num_generations", "4"), metrics, base=PROMPTS, train=True, prepare=prompt_files
    ),
    "grpo.prompt_field": Probe(
        ("--grpo.prompt_field", "question"), first_batch, base=PROMPTS, prepare=prompt_files
    ),
    "grpo.text_prompts": Probe(
        ("--grpo.text_prompts", "user_turn"),
        first_batch,
        base=(*PROMPTS, "--grpo.prompt_field", "question"),
        prepare=prompt_files,
    ),  # fmt: skip
    "grpo.system_prompt": Probe(
        ("--grpo.system_prompt", "Answer with a number."), first_batch, base=PROMPTS, prepare=prompt_files
    ),
    "grpo.max_prompt_length": Probe(
        ("--grpo.max_prompt_length", "30"), metrics, base=PROMPTS, train=True, prepare=prompt_files
    ),
    "grpo.overlong_prompts": Probe(
        ("--grpo.overlong_prompts", "drop"), metrics, base=PROMPTS, train=True, prepare=prompt_files
    ),
    "grpo.max_completion_length": Probe(
        ("--grpo.max_completion_length", "4"), metrics, base=PROMPTS, train=True, prepare=prompt_files
    ),
    "grpo.temperature": Probe(
        ("--grpo.temperature", "0.5"), metrics, base=PROMPTS, train=True, prepare=prompt_files
    ),
    "grpo.top_p": Probe(("--grpo.top_p", "0.3"), metrics, base=PROMPTS, train=True, prepare=prompt_files),
    "grpo.top_k": Probe(("--grpo.top_k", "3"), metrics, base=PROMPTS, train=True, prepare=prompt_files),
    "grpo.engine": refused(
        ("--grpo.engine", "vllm", "--grpo.vllm_project", "no_vllm_here"),
        r"grpo.engine = 'vllm' needs the vLLM environment .*uv sync --project apps/vllm --locked",
        base=PROMPTS,
        prepare=prompt_files,
    ),
    # The vllm_* fields apply to the vllm engine (test_grpo_vllm runs it): with the titan engine, refused.
    **{
        f"grpo.{name}": refused(
            (f"--grpo.{name}", value),
            rf"grpo.{name} set, but grpo.engine is 'titan'",
            base=PROMPTS,
            prepare=prompt_files,
        )
        for name, value in (
            ("vllm_url", "http://127.0.0.1:1"),
            ("vllm_project", "elsewhere"),
            ("vllm_gpu_memory_utilization", "0.3"),
            ("vllm_importance_sampling_correction", "false"),
            ("vllm_importance_sampling_mode", "token_truncate"),
            ("vllm_importance_sampling_clip_max", "2.0"),
            ("vllm_importance_sampling_clip_min", "0.5"),
            ("vllm_server_timeout", "5"),  # honoured with vllm: test_vllm_server_failures.py
        )
    },  # fmt: skip
    "grpo.replay_rollouts": Probe(
        ("--grpo.replay_rollouts", "rollouts.jsonl"), metrics, base=PROMPTS, train=True, prepare=prompt_files
    ),
    "grpo.reward_funcs": Probe(
        ("--grpo.reward_funcs", "probe_rewards:vowels,probe_rewards:length"),
        metrics,
        base=PROMPTS,
        train=True,
        prepare=prompt_files,
    ),
    "grpo.reward_weights": Probe(
        ("--grpo.reward_weights", "1,3"), metrics, base=PROMPTS, train=True, prepare=prompt_files
    ),
    "grpo.scale_rewards": Probe(
        ("--grpo.scale_rewards", "none"), metrics, base=PROMPTS, train=True, prepare=prompt_files
    ),
    "grpo.loss_type": Probe(
        ("--grpo.loss_type", "grpo"), metrics, base=PROMPTS, train=True, prepare=prompt_files
    ),
    "grpo.beta": Probe(("--grpo.beta", "0.1"), metrics, base=PROMPTS, train=True, prepare=prompt_files),
    "grpo.epsilon": Probe(("--grpo.epsilon", "0.5"), grpo_loss, base=PROMPTS, prepare=prompt_files),
    "grpo.epsilon_high": Probe(("--grpo.epsilon_high", "0.5"), grpo_loss, base=PROMPTS, prepare=prompt_files),
    "grpo.delta": Probe(("--grpo.delta", "2.0"), grpo_loss, base=PROMPTS, prepare=prompt_files),
    "grpo.importance_sampling_level": Probe(
        ("--grpo.importance_sampling_level", "sequence"), grpo_loss, base=PROMPTS, prepare=prompt_files
    ),
    "grpo.use_bias_correction_kl": Probe(
        ("--grpo.use_bias_correction_kl", "false"), grpo_loss, base=PROMPTS, prepare=prompt_files
    ),
    "grpo.mask_truncated_completions": Probe(
        ("--grpo.mask_truncated_completions",), metrics, base=PROMPTS, train=True, prepare=prompt_files
    ),
    "grpo.num_iterations": Probe(
        ("--grpo.num_iterations", "2"), metrics, base=PROMPTS, train=True, prepare=prompt_files
    ),
    "grpo.max_staleness": Probe(
        ("--grpo.max_staleness", "1"), metrics, base=PROMPTS, train=True, prepare=prompt_files
    ),
    "grpo.sapo_temperature_pos": Probe(
        ("--grpo.sapo_temperature_pos", "2.0"), grpo_loss, base=PROMPTS, prepare=prompt_files
    ),
    "grpo.sapo_temperature_neg": Probe(
        ("--grpo.sapo_temperature_neg", "2.0"), grpo_loss, base=PROMPTS, prepare=prompt_files
    ),
    "grpo.reference": Probe(
        ("--grpo.reference", "copy"),
        lambda s: s.outcome or s.trainer.objective.source,
        base=(*PROMPTS, *LORA, "--grpo.beta", "0.1"),
        prepare=prompt_files,
    ),
    "sft.format": Probe(("--sft.format", "prompt_completion"), chat_batch, base=CHAT, prepare=chat_files),
    "sft.messages_field": Probe(("--sft.messages_field", "conv"), chat_batch, base=CHAT, prepare=chat_files),
    "sft.prompt_field": Probe(
        ("--sft.prompt_field", "q"),
        chat_batch,
        base=(*CHAT, "--sft.format", "prompt_completion"),
        prepare=chat_files,
    ),
    "sft.completion_field": Probe(
        ("--sft.completion_field", "a"),
        chat_batch,
        base=(*CHAT, "--sft.format", "prompt_completion"),
        prepare=chat_files,
    ),
    "sft.loss_on": Probe(("--sft.loss_on", "all"), chat_batch, base=CHAT, prepare=chat_files),
    "sft.packing": Probe(("--sft.packing", "false"), chat_batch, base=CHAT, prepare=chat_files),
    "sft.overlong": Probe(("--sft.overlong", "drop"), chat_batch, base=CHAT, prepare=chat_files),
    "sft.bad_rows": Probe(
        ("--sft.bad_rows", "stop"),
        chat_batch,
        base=(
            "--training.dataset",
            "chat",
            "--training.dataset_path",
            "chat_bad.jsonl",
            "--sft.bad_rows",
            "skip",
        ),
        prepare=chat_files,
        may_stop=True,
    ),
    "sft.chat_template": Probe(
        ("--sft.chat_template", "other_template.jinja"), chat_batch, base=CHAT, prepare=chat_files
    ),
    # the bundled template writes {{ bos_token }} first: a variable the user passes replaces it, as in transformers
    "sft.template_variables": Probe(
        ("--sft.template_variables", '{"bos_token": "<|eot_id|>"}'), chat_batch, base=CHAT, prepare=chat_files
    ),
}


def test_the_table_covers_every_field():
    fields = [name for name, _, _ in iter_fields(JobConfig)]
    assert sorted(PROBES) == sorted(fields), {
        "fields without a probe": sorted(set(fields) - set(PROBES)),
        "probes for no field": sorted(set(PROBES) - set(fields)),
    }
    print(
        f"{len(fields)} JobConfig fields: {sum(p.observe is not None for p in PROBES.values())} honoured, "
        f"{sum(p.observe is None for p in PROBES.values())} refused"
    )


def test_mx_recipe_that_needs_mx_matmuls_is_refused_in_one_line_on_this_cpu(tmp_path, monkeypatch, capfd):
    """The default MX recipe runs on CUDA SM100+ only; here it stops at start, naming the field and the device."""
    status, errors, _ = _launch(tmp_path, Probe(()), ("--model.converters", "mx"), monkeypatch, capfd)
    assert status == 2 and len(errors) == 1, errors
    assert re.search(
        r"quantize\.linear\.mx\.recipe_name = 'mxfp8_cublas' needs MXFP8 matmuls, on a CUDA GPU of compute "
        r"capability 10\.0 or newer .* this run is on cpu; use recipe_name = 'mxfp8_emulated'",
        errors[0],
    ), errors[0]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One thread per process, as the project's other training tests run: the probes' models are tiny, and
    on a shared CPU torch's thread pool spins against other processes (a 2-step run took 3-10 s, not 0.6)."""
    threads = torch.get_num_threads()
    mp = pytest.MonkeyPatch()
    mp.setenv("OMP_NUM_THREADS", "1")  # the memory trace's child processes
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    mp.undo()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints of a finished 2-step run with full state at steps 1 and 2, for the probes that load."""
    global SAVED
    root = tmp_path_factory.mktemp("saved")
    mp = pytest.MonkeyPatch()
    try:
        seen = launch(root, [*BASE, *CKPT, "--checkpoint.no_last_save_model_only"], mp, train=True)
    finally:
        mp.undo()
    assert seen.status == 0, seen.errors
    SAVED = seen.dump / "checkpoint"
    return SAVED


# (flags after BASE, world, train, prepare, observer) -> (exit status, error lines, what the observer saw)
_launches: dict[tuple, tuple[int, list[str], Any]] = {}


def _key(probe: Probe, flags: tuple[str, ...], observe: Callable[[Seen], Any] | None) -> tuple:
    return ((*probe.base, *flags), probe.world, probe.train, probe.prepare, observe)


def _readers(launch: tuple) -> list[tuple[Callable[[Seen], Any], bool]]:
    """Every observer that only reads, with whether its probe may stop at start, of the probes that make
    `launch` (flags, layout and files, observer left out), as base or as change."""
    found = {}
    for probe in PROBES.values():
        if probe.observe is None or getattr(probe.observe, "alters", False):
            continue
        for flags in ((), probe.change):
            if _key(probe, flags, None) == launch:
                found[probe.observe] = found.get(probe.observe, False) or probe.may_stop
    return list(found.items())


class _Raised:
    """What an observer raised on a launch another probe asked for: raised again in its own test."""

    def __init__(self, err: BaseException):
        self.err = err


def _launch(
    tmp: Path, probe: Probe, flags: tuple[str, ...], monkeypatch, capfd
) -> tuple[int, list[str], Any]:
    """Launch with the probe's base and `flags`, and observe it; a launch some probe already made with the
    same flags, layout and files, observed the same way (its base or its change), is not made again. Each
    launch is observed at once by every observer that only reads it (`_readers`); one that `alters` what
    it looks at observes a launch of its own."""
    observe = probe.observe
    own = observe is not None and getattr(observe, "alters", False)
    key = _key(probe, flags, observe if own else None)
    if (*key[:-1], observe) not in _launches:
        if probe.prepare is not None:
            tmp.mkdir(parents=True)
            probe.prepare(tmp)
        seen = launch(tmp, [*BASE, *probe.base, *flags], monkeypatch, world=probe.world, train=probe.train)
        seen.lines += capfd.readouterr().out.splitlines()  # what child processes (the memory trace) printed
        readers = [(observe, probe.may_stop)] if own else [(None, False), *_readers(key)]
        for reader, may_stop in readers:
            observed = None
            if reader is not None and (seen.status != 2 or may_stop):
                try:
                    observed = reader(seen)
                except Exception as err:  # noqa: BLE001 - raised in the test of the probe that asked
                    observed = _Raised(err)
            _launches[(*key[:-1], reader)] = (seen.status, seen.errors, observed)
    status, errors, observed = _launches[(*key[:-1], observe)]
    if isinstance(observed, _Raised):
        raise observed.err
    return status, errors, observed


@pytest.mark.parametrize("name", sorted(PROBES))
def test_field_is_honoured_or_refused(name, tmp_path, monkeypatch, capfd, saved):
    probe = PROBES[name]
    status, errors, before = _launch(tmp_path / "base", probe, (), monkeypatch, capfd)
    assert status != 2, f"the base launch of {name} was refused: {errors}"
    status, errors, after = _launch(tmp_path / "changed", probe, probe.change, monkeypatch, capfd)
    if probe.observe is None:
        assert status == 2, f"{name}: {probe.change} was accepted (status {status}), not refused"
        assert len(errors) == 1 and "\n" not in errors[0], errors
        assert re.search(probe.refusal, errors[0]), errors[0]
        return
    assert status != 2 or probe.may_stop, f"{name}: {probe.change} was refused: {errors}"
    assert after != before, (
        f"{name}: changing it ({' '.join(probe.change)}) changed nothing observed: {after!r}"
    )
