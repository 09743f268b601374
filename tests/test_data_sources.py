"""titan-train on C4 from a loopback stand-in for the hub: an unreachable hub or an empty dataset_path is
one line and exit 2 at start; dropped connections change nothing in the losses; a hub that stays down
ends the run with a checkpoint of the last completed step and the retryable exit status 3, and the
rerun continues exactly. With two ranks, a hub down for one of them stops both at the same step, saved
together (the ranks agree each step that all have their batches, `titan_train.faults.data_outage`)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fault_runs import REPO, cli_args, start_forked, start_forked_ranks  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "c4_hub_server", REPO / "packages" / "titan-data" / "tests" / "c4_hub_server.py"
)
c4_hub_server = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(c4_hub_server)
C4HubServer = c4_hub_server.C4HubServer
unreachable_endpoint = c4_hub_server.unreachable_endpoint

CORPUS = REPO / "packages" / "titan-data" / "src" / "titan_data" / "assets" / "c4_test" / "c4_test.jsonl"
TEXTS = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines()]
DOCS_PER_FILE = 4  # about 800 tokens a file: a few steps of 2 x 65 tokens each
FIRST = "en/c4-train.00000-of-01024.json.gz"
SECOND = "en/c4-train.00001-of-01024.json.gz"
FOURTH = "en/c4-train.00003-of-01024.json.gz"  # stream 1 reads files 1, 3, ...; stream 0 never leaves file 0
STEPS = 12


def _env(endpoint: str) -> dict[str, str]:
    return {
        "HF_ENDPOINT": endpoint,
        "HF_HUB_OFFLINE": "0",
        "HF_DATASETS_OFFLINE": "0",
        "PYTHONUNBUFFERED": "1",
        "TITAN_DATA_HTTP_ATTEMPTS": "2",
        "TITAN_DATA_HTTP_BACKOFF_S": "0.05",
        "TITAN_DATA_HTTP_TIMEOUT_S": "10",
    }


def _run_all(runs: dict[str, tuple[list[str], dict | list[dict]]], logs: Path) -> dict[str, tuple[int, str]]:
    """Each run, all at once, forked titan-train processes: (exit status, output) by name. A run given a
    list of environments is that many ranks of one process group (gloo), named `NAME.rankR`."""
    logs.mkdir(parents=True, exist_ok=True)
    processes = {}
    for name, (argv, env) in runs.items():
        if isinstance(env, list):
            (logs / name).mkdir()
            ranks = start_forked_ranks(argv, len(env), logs / name, lambda rank, env=env: env[rank])
            processes.update(
                {f"{name}.rank{r}": (p, logs / name / f"rank{r}.log") for r, p in enumerate(ranks)}
            )
        else:
            processes[name] = (start_forked(argv, env, logs / f"{name}.log"), logs / f"{name}.log")
    for process, _ in processes.values():
        process.join(timeout=300)
    for process, _ in processes.values():
        if process.exitcode is None:
            process.kill()
    return {name: (p.exitcode, log.read_text()) for name, (p, log) in processes.items()}


def _losses(dump: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.mark.slow
def test_c4_at_start_through_drops_and_through_an_outage(tmp_path, monkeypatch):
    """One launch of six runs and a two-rank run, then three: three that cannot reach their data (exit
    2, one line); one undisturbed, one through dropped connections (the same losses), one whose hub goes
    down for good (a checkpoint and exit 3); two ranks whose hub goes down for rank 1 only (both exit 3
    at the same step, one checkpoint); then the reruns of those two (the undisturbed run's losses again)
    and a run from a copy `titan-data prepare` wrote (trains).

    Two streams everywhere: the two ranks at batch 1 train on the global batches of one process at
    batch 2, so the undisturbed run is the reference of both (to float rounding: FSDP sums over ranks).
    """
    from titan_data.cli import main as titan_data

    ckpt = (
        "--training.steps",
        str(STEPS),
        "--checkpoint.enable",
        "--checkpoint.interval",
        "100",
        "--training.dataloader.num_streams",
        "2",
    )
    # Rank 1 retries for 3 x 6 s before giving up, longer than training's collective timeout: rank 0 must
    # wait for it in the agreement (its own group's timeout covers the retries), not time out with exit 5.
    two_ranks = ("--training.local_batch_size", "1", "--comm.train_timeout_seconds", "10")
    validation = ("--validation.enable", "--validation.freq", "2", "--validation.steps", "1")
    (tmp_path / "empty").mkdir()
    with (
        unreachable_endpoint() as gone,
        C4HubServer(TEXTS, docs_per_file=DOCS_PER_FILE) as steady,
        C4HubServer(TEXTS, docs_per_file=DOCS_PER_FILE) as flaky,
        C4HubServer(TEXTS, docs_per_file=DOCS_PER_FILE) as failing,
        C4HubServer(TEXTS, docs_per_file=DOCS_PER_FILE) as failing_rank1,
    ):
        dead = _env(gone)
        for name in (FIRST, SECOND, FOURTH):
            size = len(flaky.file(name))
            flaky.cut[name] = [size // 4, size // 3, size // 5]  # three drops inside each file
        # Down in the middle of stream 1's second file, step 8 or so: the start check's byte, FIRST (stream
        # 0: the one process only), SECOND, half of FOURTH.
        stream1 = 1 + len(failing.file(SECOND)) + len(failing.file(FOURTH)) // 2
        failing.down_after_bytes = len(failing.file(FIRST)) + stream1
        failing_rank1.down_after_bytes = stream1
        runs = {
            name: (cli_args(tmp_path / name, "--training.dataset", "c4", *ckpt), _env(hub.url))
            for name, hub in (("steady", steady), ("flaky", flaky), ("failing", failing))
        }
        runs["two_ranks"] = (
            cli_args(tmp_path / "two_ranks", "--training.dataset", "c4", *ckpt, *two_ranks),
            [
                _env(steady.url),
                {**_env(failing_rank1.url), "TITAN_DATA_HTTP_BACKOFF_S": "6"},
            ],  # rank 1 reads stream 1 (SECOND, FOURTH) through its own proxy
        )
        runs["c4"] = (cli_args(tmp_path / "a", "--training.dataset", "c4"), dead)
        runs["c4_validation"] = (
            cli_args(tmp_path / "b", *validation, "--validation.dataset", "c4_validation"),
            dead,
        )
        runs["empty_path"] = (
            cli_args(
                tmp_path / "c", "--training.dataset", "c4", "--training.dataset_path", str(tmp_path / "empty")
            ),
            dead,
        )
        results = _run_all(runs, tmp_path / "logs")
        done = max(_losses(tmp_path / "failing"))
        done_two_ranks = max(_losses(tmp_path / "two_ranks"), default=0)
        with C4HubServer(TEXTS, docs_per_file=DOCS_PER_FILE, listed={"train": 2, "validation": 1}) as back:
            monkeypatch.setenv("HF_ENDPOINT", back.url)
            for dataset, shards in (("c4", "2"), ("c4_validation", "1")):
                assert (
                    titan_data(
                        [
                            "prepare",
                            dataset,
                            "--output",
                            str(tmp_path / "copy"),
                            "--shards",
                            shards,
                            "--quiet",
                        ]
                    )
                    == 0
                )
            copy = (
                "--training.dataset_path",
                str(tmp_path / "copy"),
                "--validation.dataset_path",
                str(tmp_path / "copy"),
            )
            later = {
                "rerun": (runs["failing"][0], _env(back.url)),  # the hub answers again, at another address
                "rerun_two_ranks": (runs["two_ranks"][0], [_env(back.url)] * 2),
                "prepared": (
                    cli_args(
                        tmp_path / "d",
                        "--training.dataset",
                        "c4",
                        "--training.steps",
                        "2",
                        *validation,
                        "--validation.dataset",
                        "c4_validation",
                        *copy,
                    ),
                    dead,
                ),
            }
            results.update(_run_all(later, tmp_path / "logs_later"))

    says = {
        "c4": f"dataset: 'c4' streams allenai/c4 from {gone}, but",
        "c4_validation": f"dataset: 'c4_validation' streams allenai/c4 from {gone}, but",
        "empty_path": "dataset: 'c4' found no C4 files under",
    }
    for name, fragment in says.items():
        status, output = results[name]
        errors = [line for line in output.splitlines() if "ERROR" in line]
        assert status == 2 and "Traceback" not in output, output[-3000:]
        assert len(errors) == 1 and fragment in errors[0], output[-3000:]
        assert "titan-data prepare" in errors[0] and "HF_DATASETS_OFFLINE=1" in errors[0]
        assert name == "empty_path" or "Connection refused" in errors[0]
    status, output = results["prepared"]
    assert status == 0, output[-3000:]
    assert set(_losses(tmp_path / "d")) == {1, 2}

    for name in ("steady", "flaky"):
        assert results[name][0] == 0, results[name][1][-3000:]
    resumed = sum(1 for _, r in flaky.requests if r)
    assert resumed >= 6  # the drops happened, each resumed with a Range request
    reference = _losses(tmp_path / "steady")
    assert set(reference) == set(range(1, STEPS + 1))
    assert _losses(tmp_path / "flaky") == reference

    status, output = results["failing"]
    stops = [line for line in output.splitlines() if "data unavailable:" in line]
    assert status == 3 and "Traceback" not in output, output[-3000:]
    assert len(stops) == 1 and "stopped answering" in stops[0] and "run the same command again" in stops[0]
    assert STEPS // 2 < done < STEPS and f"finished step {done} and saved" in stops[0]
    assert (tmp_path / "failing" / "checkpoint" / f"step-{done}").is_dir()
    assert results["rerun"][0] == 0, results["rerun"][1][-3000:]
    assert _losses(tmp_path / "failing") == reference  # the rerun resumed at the step after, on the same data

    for rank in (0, 1):
        status, output = results[f"two_ranks.rank{rank}"]
        stops = [line for line in output.splitlines() if "data unavailable:" in line]
        assert status == 3 and "Traceback" not in output, output[-3000:]
        assert len(stops) == 1, output[-3000:]
        assert f"rank 1's source: dataset: {failing_rank1.url}" in stops[0] and FOURTH in stops[0]
        assert f"finished step {done_two_ranks} and saved" in stops[0]
        assert results[f"rerun_two_ranks.rank{rank}"][0] == 0, results[f"rerun_two_ranks.rank{rank}"][1][
            -3000:
        ]
    assert done_two_ranks == done  # rank 1 lost its source where the one process lost stream 1's
    assert (tmp_path / "two_ranks" / "checkpoint" / f"step-{done_two_ranks}").is_dir()
    two_ranks_losses = _losses(tmp_path / "two_ranks")
    assert set(two_ranks_losses) == set(reference)
    assert two_ranks_losses == pytest.approx(reference, rel=1e-5, abs=0)
