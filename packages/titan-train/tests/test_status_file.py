"""The exit status a rank leaves for its launcher (apps/multinode_trainer.slurm reads it)."""

from titan_train.cli import main
from titan_train.faults.status_file import leave_exit_status


def test_each_rank_leaves_its_exit_status_where_the_launcher_asks(tmp_path, monkeypatch):
    monkeypatch.delenv("TITAN_EXIT_STATUS_DIR", raising=False)
    leave_exit_status(3)  # no folder asked for: nothing written, nothing raised
    monkeypatch.setenv("TITAN_EXIT_STATUS_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "5")
    leave_exit_status(3)
    assert (tmp_path / "rank5").read_text() == "3\n"
    # The CLI leaves the status it exits with: here 2, a config mistake.
    assert main(["--training.steps", "-1"]) == 2
    assert (tmp_path / "rank5").read_text() == "2\n"
    monkeypatch.setenv("TITAN_EXIT_STATUS_DIR", str(tmp_path / "missing"))
    leave_exit_status(1)  # an unwritable folder only warns
