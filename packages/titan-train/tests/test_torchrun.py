"""The one torchrun launcher the multi-process tests share (titan_train.torchrun)."""

import sys

from titan_train.torchrun import run_torchrun, torchrun_command


def test_the_command_names_the_rendezvous_the_restarts_and_the_target():
    command = torchrun_command(
        "-m",
        "titan_train.cli",
        "--training.steps",
        "3",
        nproc=2,
        port=29512,
        nnodes=2,
        node_rank=1,
        max_restarts=1,
        monitor_interval=0.5,
        tag_ranks=True,
    )
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"]
    flags = " ".join(command[3:])
    assert "--nnodes 2 --node-rank 1 --nproc-per-node 2" in flags
    assert "--rdzv-backend c10d --rdzv-endpoint localhost:29512 --rdzv-id titan-29512" in flags
    assert "--max-restarts 1 --monitor-interval 0.5 --role rank --tee 3" in flags
    assert command[-4:] == ["-m", "titan_train.cli", "--training.steps", "3"]


def test_a_job_runs_its_ranks_with_one_thread_each_and_the_environment_given(tmp_path):
    # Each rank writes its own file: ranks share one stdout pipe, and unbuffered writes interleave there.
    script = tmp_path / "rank.py"
    script.write_text(
        "import os, pathlib, sys\n"
        "line = ' '.join(['rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], 'threads',"
        " os.environ['OMP_NUM_THREADS'], os.environ['TITAN_TEST_VALUE']])\n"
        "pathlib.Path(sys.argv[1], 'rank' + os.environ['RANK']).write_text(line)\n"
    )
    result = run_torchrun(str(script), str(tmp_path), nproc=2, timeout=120, env={"TITAN_TEST_VALUE": "given"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(path.read_text() for path in tmp_path.glob("rank[0-9]")) == [
        "rank 0 of 2 threads 1 given",
        "rank 1 of 2 threads 1 given",
    ]
