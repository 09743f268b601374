"""Generation and evaluation straight from the checkpoints real titan-train runs write.

One torchrun launch (2 ranks, gloo) trains the debug model cut to 2 layers for 3 steps twice, through
titan-train's Trainer (tests/workers/layout_matrix.py): with FSDP over 2 ranks, its last save also
exported to Hugging Face files beside the DCP files, and with tensor parallelism over 2 ranks. Each
DCP checkpoint is then loaded in this one process (DCP reshards it) and must generate what the
unsharded model does: the run's own weights, gathered whole by the worker. On tasks defined here over
local JSON files (no download), lm-eval's own `hf` backend on the exported folder and Titan's wrapper
on the DCP files must give the same scores and the same generated answers.
"""

import json
import logging
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from titan_data.datasets.registry import ASSETS
from titan_models import SamplingParams, Transformer, generate
from titan_train.cli import run
from titan_train.commands.checkpoint_model import load_checkpoint_model
from titan_train.config import load_job_config
from titan_train.registry import get_model_family, register_flavor
from titan_train.torchrun import run_torchrun

pytestmark = pytest.mark.slow

WORKER = Path(__file__).parent / "workers" / "layout_matrix.py"
DEBUG_CONFIG = Path(__file__).parents[1] / "apps" / "configs" / "debug_model.toml"
STEPS = 3
MODEL = ("--job.config_file", str(DEBUG_CONFIG), "--model.flavor", "debug_2_layers")
BASE = (
    *MODEL,
    "--metrics.disable_color_printing",
    "--metrics.log_freq",
    "1",
    "--training.steps",
    str(STEPS),
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
    "--optimizer.lr",
    "1e-2",
    "--lr_scheduler.warmup_steps",
    "1",
    "--checkpoint.enable",
    "--checkpoint.interval",
    "100",
)
P = "--parallelism."
LAYOUTS = {
    "fsdp": [*BASE, f"{P}data_parallel_shard_degree", "2", "--checkpoint.last_save_in_hf"],
    "tp": [*BASE, f"{P}data_parallel_shard_degree", "1", f"{P}tensor_parallel_degree", "2"],
}
PROMPTS = ["Return the number of items", "def main(", "The"]
# The worker's 2-layer debug model, registered here too so that the config names it in this process.
register_flavor("llama3", "debug_2_layers", get_model_family("llama3").args_for("debugmodel", n_layers=2))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """The dump folders of both runs: OUT/fsdp, OUT/tp (checkpoint/step-3, weights_rank0.pt)."""
    return train_both(tmp_path_factory.mktemp("generate_eval"))


def train_both(out: Path) -> Path:
    (out / "layouts.json").write_text(json.dumps(LAYOUTS))
    result = run_torchrun(str(WORKER), str(out / "layouts.json"), str(out), nproc=2, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    results = json.loads((out / "results.json").read_text())
    assert results["fsdp"]["facts"]["fsdp"] and results["tp"]["facts"]["wq_placements"] == ["S(0)"]
    return out


def _config(*overrides: str):
    return load_job_config([*MODEL, *overrides])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sharded_checkpoint_generates_in_one_process_as_the_unsharded_model(runs, layout):
    step = runs / layout / "checkpoint" / f"step-{STEPS}"
    loaded = load_checkpoint_model(
        _config(), step, device=torch.device("cpu"), weights="dcp", max_seq_len=128
    )
    assert loaded.step == STEPS and not loaded.hf

    gathered = torch.load(runs / layout / "weights_rank0.pt")  # gathered whole by the run itself
    unsharded = Transformer(replace(loaded.model.args)).eval()
    unsharded.load_state_dict(gathered)
    mine = loaded.model.state_dict()
    assert all(torch.equal(mine[k], v) for k, v in gathered.items()), layout

    tok = loaded.tokenizer
    prompts = [tok.encode(p, bos=True) for p in PROMPTS]
    got = generate(loaded.model, prompts, SamplingParams(max_new_tokens=32)).tokens
    # The reference is another path through another model object: the run's own gathered weights run
    # whole over prompt + generation (no KV cache, no batching), where every generated token must be the
    # greedy choice (a near-tie within 1e-5 of the best logit counts as one).
    for prompt, tokens in zip(prompts, got, strict=True):
        _assert_greedy_under_full_forward(unsharded, prompt, tokens)
    assert all(len(t) == 32 for t in got) and len({tuple(t) for t in got}) == len(PROMPTS)


@torch.no_grad()
def _assert_greedy_under_full_forward(model, prompt: list[int], generated: list[int]) -> None:
    logits = model(torch.tensor([prompt + generated]))[0, len(prompt) - 1 : -1].float()
    chosen = logits.gather(1, torch.tensor(generated)[:, None])[:, 0]
    margin = logits.max(dim=1).values - chosen
    assert margin.max().item() <= 1e-5, f"generated token {int(margin.argmax())} is not the greedy choice"


def test_generate_command_prints_the_text_and_tokens_per_second(runs, capsys, caplog):
    step = runs / "fsdp" / "checkpoint" / f"step-{STEPS}"
    argv = [
        "generate",
        "--checkpoint",
        str(step),
        "--device",
        "cpu",
        "--prompt",
        PROMPTS[0],
        "--prompt",
        PROMPTS[1],
        "--max-new-tokens",
        "12",
        "--no-eos-stop",
        *MODEL,
    ]
    with caplog.at_level(logging.INFO):
        assert run(argv) == 0
    # It names the checkpoint it loads, not "no checkpoint in X" as a run's folder would say.
    assert f"checkpoint: loading the model weights of {step} (DCP checkpoint)" in caplog.text
    assert "no checkpoint in" not in caplog.text
    printed = capsys.readouterr().out
    loaded = load_checkpoint_model(_config(), step, device=torch.device("cpu"), max_seq_len=64)
    tok = loaded.tokenizer
    expected = generate(
        loaded.model,
        [tok.encode(p, bos=True) for p in PROMPTS[:2]],
        SamplingParams(max_new_tokens=12),
        decode=tok.decode,
    ).texts
    for prompt, text in zip(PROMPTS, expected, strict=False):
        assert f"{prompt}{text}\n" in printed
    assert "generated 24 tokens for 2 prompts in" in printed and "tokens/s on cpu (float32)" in printed
    assert run([*argv[: -len(MODEL)], "--top-p", "0", *MODEL]) == 2  # a bad setting: one line, status 2


# -- lm-eval ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    return write_tasks(tmp_path_factory.mktemp("tasks"))


@pytest.fixture(scope="module")
def task_manager(tasks):
    """One lm-eval task index of the local tasks alone, for both backends: indexing lm-eval's own thousands
    of task YAML files took most of a CPU-minute per index and none of them runs here."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(tasks), include_defaults=False)


def write_tasks(folder: Path) -> Path:
    """Three lm-eval tasks over JSON files of the bundled corpus: multiple choice, rolling perplexity,
    and generation until a stop string."""
    docs = [json.loads(line)["text"] for line in (ASSETS / "c4_test" / "c4_test.jsonl").open()]
    docs = [d for d in docs if len(d) > 300][:40]
    rows = {
        "mc": [
            {
                "question": d[:100],
                "choices": [docs[(i + k) % 40][100:140] for k in (0, 7, 13, 29)],
                "label": 0,
            }
            for i, d in enumerate(docs[:6])
        ],
        "ppl": [{"text": d[:600]} for d in docs[10:13]],
        "gen": [{"question": d[:80], "answer": d[80:120]} for d in docs[20:24]],
    }
    specs = {
        "mc": 'output_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
        "doc_to_target: label\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n",
        "ppl": 'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n'
        "  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n",
        "gen": 'output_type: generate_until\ndoc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: [" the", "\\n\\n"]\n  max_gen_toks: 12\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n",
    }
    for name, records in rows.items():
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in records))
        (folder / f"{name}.yaml").write_text(
            f"task: titan_local_{name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\n{specs[name]}"
        )
    return folder


TASK_NAMES = ["titan_local_mc", "titan_local_ppl", "titan_local_gen"]


def _evaluate(model, task_manager) -> dict:
    import lm_eval

    return lm_eval.simple_evaluate(
        model=model,
        tasks=TASK_NAMES,
        task_manager=task_manager,
        log_samples=True,
        bootstrap_iters=0,
    )


def test_lm_eval_hf_backend_on_the_export_and_titan_on_the_dcp_files_score_the_same(
    runs, task_manager, monkeypatch
):
    from lm_eval.models.huggingface import HFLM

    from titan_train.commands.lm_eval_model import TitanLM

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    step = runs / "fsdp" / "checkpoint" / f"step-{STEPS}"
    assert (step / ".metadata").is_file() and (step / "config.json").is_file()  # DCP files and the export
    loaded = load_checkpoint_model(
        _config(), step, device=torch.device("cpu"), weights="dcp", max_seq_len=256
    )
    titan = _evaluate(
        TitanLM(loaded.model, loaded.tokenizer, batch_size=4, max_length=loaded.max_seq_len), task_manager
    )
    try:
        hf = _evaluate(
            HFLM(pretrained=str(step), max_length=256, batch_size=4, device="cpu", dtype="float32"),
            task_manager,
        )
    finally:
        # lm-eval's HF backend (through accelerate) left a default process group initialized in CI, which
        # broke the next in-process runs on the same worker: leave none to the next test.
        if dist.is_initialized():
            dist.destroy_process_group()

    exact = {"titan_local_mc": ("acc,none", "acc_norm,none"), "titan_local_gen": ("exact_match,none",)}
    for task, metrics in exact.items():
        for metric in metrics:
            assert titan["results"][task][metric] == hf["results"][task][metric], (task, metric)
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        got, want = titan["results"]["titan_local_ppl"][metric], hf["results"]["titan_local_ppl"][metric]
        assert math.isclose(got, want, rel_tol=1e-5), (metric, got, want)
    # Sample by sample: the same log-likelihoods (to float32 rounding) and the same generated text.
    for task in TASK_NAMES:
        for mine, theirs in zip(titan["samples"][task], hf["samples"][task], strict=True):
            if task == "titan_local_gen":
                assert mine["filtered_resps"] == theirs["filtered_resps"]
            else:
                for a, b in zip(_numbers(mine["resps"]), _numbers(theirs["resps"]), strict=True):
                    assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (task, a, b)
    answers = [s["filtered_resps"][0] for s in titan["samples"]["titan_local_gen"]]
    # Real, differing text: at least two distinct non-empty answers (a stop string may end one at once).
    assert len({a for a in answers if a}) > 1, answers
    assert len({_numbers(s["resps"])[0] for s in titan["samples"]["titan_local_mc"]}) > 1


def _numbers(value) -> list[float]:
    """The numbers of a sample's responses (log-likelihoods, greedy flags), in order."""
    if isinstance(value, (list, tuple)):
        return [x for item in value for x in _numbers(item)]
    return [float(value)]


def test_eval_command_writes_json_and_tensorboard_at_the_checkpoint_step(runs, tasks, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    dump = runs / "tp"
    step = dump / "checkpoint" / f"step-{STEPS}"
    argv = [
        "eval",
        "--checkpoint",
        str(step),
        "--device",
        "cpu",
        "--max-seq-len",
        "128",
        "--tasks",
        "titan_local_mc",
        "--include-path",
        str(tasks),
        *MODEL,
        "--job.dump_folder",
        str(dump),
        "--metrics.enable_tensorboard",
        "--validation.seq_len",
        "64",
        "--validation.local_batch_size",
        "2",
        "--validation.steps",
        "2",
    ]
    assert run(argv) == 0
    record = json.loads((dump / "eval" / f"step-{STEPS}.json").read_text())
    assert record["step"] == STEPS and record["perplexity"]["dataset"] == "c4_test"
    assert math.isclose(record["perplexity"]["perplexity"], math.exp(record["perplexity"]["loss"]))
    acc = record["lm_eval"]["results"]["titan_local_mc"]["acc,none"]

    events = EventAccumulator(str(dump / "tb")).Reload()
    scalars = {tag: events.Scalars(tag) for tag in events.Tags()["scalars"]}
    assert [(e.step, e.value) for e in scalars["eval/titan_local_mc/acc"]] == [(STEPS, pytest.approx(acc))]
    assert [e.step for e in scalars["eval/perplexity"]] == [STEPS]
