"""`titan-train eval`: perplexity and lm-evaluation-harness tasks on a checkpoint, recorded with the run.

Perplexity is measured as validation measures it during training, on the config's `[validation]`
dataset (`--validation.dataset`, `--validation.dataset_path`, `seq_len`, `local_batch_size`, `steps`).
Tasks run through lm-eval (the `eval` extra) with `TitanLM`. Results land in
`{dump_folder}/eval/step-N.json` and, with `metrics.enable_tensorboard`, in the run's TensorBoard
folder at the checkpoint's step, beside the training curves.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from titan_train.commands.checkpoint_model import CheckpointModel
from titan_train.commands.generate import checkpoint_parser, load_for
from titan_train.config import JobConfig, load_job_config
from titan_train.errors import ConfigError
from titan_train.objectives.validation import Validator
from titan_train.registry import get_model_family
from titan_train.wiring.data import build_validation_loader


def _parser() -> argparse.ArgumentParser:
    parser = checkpoint_parser(
        "titan-train eval",
        "Perplexity on the config's [validation] dataset and lm-eval tasks on a checkpoint.",
    )
    parser.add_argument(
        "--tasks", default="", help="lm-eval task names, comma-separated (needs titan-train[eval])"
    )
    parser.add_argument("--include-path", help="a folder of extra lm-eval task YAML files")
    parser.add_argument("--num-fewshot", type=int, help="few-shot examples per prompt (default: the task's)")
    parser.add_argument(
        "--limit", type=float, help="examples per task (a fraction if below 1); for a quick look"
    )
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per forward")
    parser.add_argument("--max-length", type=int, help="tokens per scored sequence (default: --max-seq-len)")
    parser.add_argument("--log-samples", action="store_true", help="keep every scored sample in the JSON")
    parser.add_argument("--no-perplexity", action="store_true", help="skip the [validation] perplexity")
    return parser


def measure_perplexity(config: JobConfig, loaded: CheckpointModel) -> dict[str, Any]:
    """Loss and perplexity over `validation.steps` batches of the `[validation]` dataset, one process."""
    v = config.validation
    loss_fn = get_model_family(config.model.name).loss_fn
    validator = Validator(
        lambda: build_validation_loader(config, loaded.tokenizer, 0, 1),
        lambda inputs, labels: loss_fn(loaded.model(inputs), labels),
        device=loaded.device,
        freq=1,
        steps=v.steps,
    )
    loss, perplexity = validator.validate([loaded.model])
    loaded.model.eval()
    return {
        "dataset": v.dataset,
        "seq_len": v.seq_len,
        "steps": v.steps,
        "loss": loss,
        "perplexity": perplexity,
    }


def run_tasks(loaded: CheckpointModel, args: argparse.Namespace) -> dict[str, Any]:
    """lm-eval's results for `args.tasks`, from `TitanLM` over the loaded model."""
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise ConfigError(
            "eval: --tasks needs lm-evaluation-harness: pip install 'titan-train[eval]' (or lm-eval)"
        ) from None
    from titan_train.commands.lm_eval_model import TitanLM

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    manager = TaskManager(include_path=args.include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ConfigError(
            f"eval: unknown lm-eval task(s) {unknown}; list them with `lm_eval ls tasks`, or pass --include-path "
            "with their YAML files"
        )
    model = TitanLM(
        loaded.model,
        loaded.tokenizer,
        batch_size=args.batch_size,
        max_length=args.max_length or loaded.max_seq_len,
    )
    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    results = lm_eval.simple_evaluate(
        model=model,
        tasks=tasks,
        num_fewshot=args.num_fewshot,
        limit=limit,
        task_manager=manager,
        log_samples=args.log_samples,
        bootstrap_iters=0,
    )
    keep = ("results", "versions", "n-shot", "n-samples", "higher_is_better") + (
        ("samples",) if args.log_samples else ()
    )
    return {key: results[key] for key in keep if key in results}


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """TensorBoard tags of the numbers in an eval record: `eval/perplexity`, `eval/TASK/METRIC`."""
    tags = {}
    if record.get("perplexity"):
        tags["eval/loss"] = record["perplexity"]["loss"]
        tags["eval/perplexity"] = record["perplexity"]["perplexity"]
    for task, metrics in record.get("lm_eval", {}).get("results", {}).items():
        for key, value in metrics.items():
            metric, _, filt = key.partition(",")
            if isinstance(value, (int, float)) and not isinstance(value, bool) and "stderr" not in metric:
                tags[f"eval/{task}/{metric}" + ("" if filt in ("", "none") else f"_{filt}")] = float(value)
    return tags


def write_results(config: JobConfig, record: dict[str, Any], step: int | None, name: str) -> Path:
    """`{dump_folder}/eval/<name>.json`, and TensorBoard scalars at `step` when the run writes TensorBoard."""
    dump = Path(config.job.dump_folder)
    out = dump / "eval" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2, default=str))
    if config.metrics.enable_tensorboard:
        from torch.utils.tensorboard import SummaryWriter

        with SummaryWriter(log_dir=str(dump / config.metrics.save_tb_folder)) as writer:
            for tag, value in scalars(record).items():
                writer.add_scalar(tag, value, step or 0)
    return out


def eval_main(argv: list[str]) -> int:
    args, rest = _parser().parse_known_args(argv)
    if args.no_perplexity and not args.tasks:
        raise ConfigError("eval: nothing to do: --no-perplexity and no --tasks")
    config = load_job_config(rest, check_paths=True)
    loaded = load_for(args, config)
    started = time.perf_counter()
    record: dict[str, Any] = {"checkpoint": str(loaded.path), "step": loaded.step}
    if not args.no_perplexity:
        record["perplexity"] = measure_perplexity(config, loaded)
        p = record["perplexity"]
        print(f"perplexity on {p['dataset']}: {p['perplexity']:.4f} (loss {p['loss']:.4f})")
    if args.tasks:
        record["lm_eval"] = run_tasks(loaded, args)
        for task, metrics in record["lm_eval"]["results"].items():
            for key, value in metrics.items():
                if isinstance(value, float) and "stderr" not in key:
                    print(f"{task:30} {key:30} {value:.6g}")
    record["seconds"] = time.perf_counter() - started
    name = loaded.path.name + ("-hf" if loaded.hf else "")
    out = write_results(config, record, loaded.step, name)
    print(f"results: {out}")
    return 0
