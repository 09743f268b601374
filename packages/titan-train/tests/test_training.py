"""The debug model trained in this process on a real one-rank gloo group: accumulation, metrics, profiling,
validation, and the run report drawn from what the run wrote."""

import json
import math

import matplotlib.image
import pytest

from titan_train.cli import run
from titan_train.plan import resolve
from titan_train.reporting.metrics import TB_TAGS, VALIDATION_TAGS
from titan_train.reporting.report import build_report, find_event_folder, read_scalars
from titan_train.trainer import Trainer
from titan_train.wiring.lr_schedule import lr_factor


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_gradient_accumulation_2x4_gives_the_losses_and_grad_norms_of_batch_8(
    tmp_path, one_rank, small_config
):
    whole = Trainer(
        resolve(
            small_config(tmp_path / "b8", "--training.local_batch_size", "8"), one_rank.world_size, "cpu"
        ),
        one_rank,
    )
    accumulated = Trainer(
        resolve(
            small_config(
                tmp_path / "b2x4", "--training.local_batch_size", "2", "--training.global_batch_size", "8"
            ),
            one_rank.world_size,
            "cpu",
        ),
        one_rank,
    )
    assert (whole.grad_accum_steps, accumulated.grad_accum_steps) == (1, 4)
    losses_whole, losses_accumulated = whole.train(), accumulated.train()
    assert len(set(losses_whole)) == 3  # three different steps, not one state compared three times
    assert losses_accumulated == pytest.approx(losses_whole, rel=1e-5)
    # AdamW and clipping hide a wrongly scaled gradient from the losses; the norm before clipping does not.
    logged = {run: _jsonl(tmp_path / run / "metrics.jsonl") for run in ("b8", "b2x4")}
    norms = {run: [r["grad_norm"] for r in records] for run, records in logged.items()}
    assert norms["b2x4"] == pytest.approx(norms["b8"], rel=1e-5)
    # Each optimizer step saw 8 sequences of 32 tokens either way.
    assert [r["tokens_seen"] for r in logged["b2x4"]] == [256, 512, 768]


PROFILED = (
    "--training.steps",
    "4",
    "--training.local_batch_size",
    "4",
    "--metrics.enable_tensorboard",
    "--profiling.enable_profiling",
    "--profiling.profile_freq",
    "2",
    "--profiling.profiler_warmup",
    "0",
    "--validation.enable",
    "--validation.dataset",
    "c4_test",
    "--validation.freq",
    "2",
    "--validation.steps",
    "2",
    "--validation.seq_len",
    "32",
    "--validation.local_batch_size",
    "4",
    "--training.gc_freq",
    "2",
)


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory, one_rank, small_config):
    dump = tmp_path_factory.mktemp("profiled")
    config = small_config(dump, *PROFILED)
    Trainer(resolve(config, one_rank.world_size, "cpu"), one_rank).train()
    return dump, config


def test_profiler_writes_a_trace_every_profile_freq_steps_that_loads_as_json(profiled_run):
    dump, _ = profiled_run
    folders = sorted(p.name for p in (dump / "profile_traces").iterdir())
    assert folders == ["iteration_2", "iteration_4"]
    for folder in folders:
        trace = json.loads((dump / "profile_traces" / folder / "rank0_trace.json").read_text())
        names = {event.get("name", "") for event in trace["traceEvents"]}
        assert any("aten::mm" in name or "aten::addmm" in name for name in names)


def test_tensorboard_events_hold_loss_grad_norm_tps_tflops_and_lr(profiled_run):
    dump, config = profiled_run
    series = read_scalars(find_event_folder(dump))
    for name in ("loss", "loss_max", "grad_norm", "tps", "tflops", "lr", "tokens_seen", "data_time_pct"):
        steps, values = series[TB_TAGS[name]]
        assert steps == [1, 2, 3, 4], name
        assert all(math.isfinite(v) for v in values), name
    assert TB_TAGS["mfu"] not in series  # the CPU's peak is unknown: tflops without mfu
    records = _jsonl(dump / "metrics.jsonl")
    assert series[TB_TAGS["loss"]][1] == pytest.approx([r["loss"] for r in records])
    s = config.lr_scheduler
    schedule = dict(
        total_steps=4,
        warmup_steps=s.warmup_steps,
        decay_ratio=s.decay_ratio,
        decay_type=s.decay_type,
        min_lr_factor=s.min_lr_factor,
    )
    expected_lr = [config.optimizer.lr * lr_factor(step, **schedule) for step in (1, 2, 3, 4)]
    assert series[TB_TAGS["lr"]][1] == pytest.approx(expected_lr, rel=1e-6)
    assert min(series[TB_TAGS["tps"]][1]) > 0


def test_metrics_jsonl_keeps_the_log_line_fields_and_adds_data_time(profiled_run):
    dump, _ = profiled_run
    record = _jsonl(dump / "metrics.jsonl")[-1]
    assert {
        "step",
        "loss",
        "loss_max",
        "grad_norm",
        "memory_gib",
        "memory_pct",
        "memory_active_gib",
        "tps",
        "tflops",
        "mfu",
    } <= set(record)
    assert record["tokens_seen"] == 4 * 4 * 32
    assert 0 <= record["data_time_pct"] <= 100 and record["data_time_s"] >= 0


def test_validation_logs_loss_and_perplexity_every_freq_steps(profiled_run):
    dump, _ = profiled_run
    records = _jsonl(dump / "validation.jsonl")
    assert [r["step"] for r in records] == [2, 4]
    for r in records:
        assert r["perplexity"] == pytest.approx(math.exp(r["loss"]))
    series = read_scalars(find_event_folder(dump))
    assert series[VALIDATION_TAGS["loss"]] == ([2, 4], pytest.approx([r["loss"] for r in records]))


def test_report_draws_the_loss_curve_into_a_png_and_prints_a_summary(profiled_run, tmp_path, capsys):
    dump, _ = profiled_run
    report = build_report(dump, tmp_path / "run.png")
    image = matplotlib.image.imread(report.png)
    assert image.ndim == 3 and image.shape[0] > 400 and image.shape[1] > 400
    assert report.table[0].split() == ["metric", "first", "last", "min", "mean", "max"]
    assert report.table[1].startswith("loss")
    assert run(["report", str(dump)]) == 0
    out = capsys.readouterr().out
    assert "tokens/s per device" in out and f"curves: {dump / 'report.png'}" in out
    assert (dump / "report.png").stat().st_size > 10_000


def test_report_figure_plots_the_logged_losses(profiled_run, tmp_path):
    from titan_train.reporting.report import draw

    dump, _ = profiled_run
    series = read_scalars(find_event_folder(dump))
    figure = draw(series, tmp_path / "fig.png", title="test")
    loss_axes = figure.axes[0]
    assert loss_axes.get_title() == "loss"
    train_line = loss_axes.lines[0]
    assert list(train_line.get_xdata()) == [1, 2, 3, 4]
    assert list(train_line.get_ydata()) == pytest.approx(series[TB_TAGS["loss"]][1])
    assert [line.get_label() for line in loss_axes.lines] == ["train", "validation"]


def test_report_on_a_folder_without_events_says_how_to_record_them(tmp_path):
    assert run(["report", str(tmp_path)]) == 2
