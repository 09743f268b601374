"""The torchft drill, three trials: a lighthouse and 2 replica groups of 2 ranks (gloo, this CPU), group 1's
rank 1 SIGKILLed after step k; group 0 trains on, group 1 is restarted by torchrun and heals from group 0.

Each row: the kill step, the steps group 0 committed with a quorum of 1, group 1's heal (the step it
healed at, the steps it missed, seconds and bytes), whether every rank of both groups ended with the same
digest of weights and optimizer state, and the wall time. The drill itself is tests/ft_drill.py (the test:
tests/test_fault_tolerance.py).

    uv run python bench/ft_drill.py [--kill-steps 6,9,12] [--steps 24]
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from ft_drill import run_drill  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kill-steps", default="6,9,12")
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    rows = []
    for k in map(int, args.kill_steps.split(",")):
        with tempfile.TemporaryDirectory(prefix=f"ft_drill_k{k}_") as folder:
            drill = run_drill(Path(folder), k, args.steps)
        live, healed = drill.groups
        alone = sorted(s for s, r in live.records.items() if s > k and r["ft_quorum_size"] == 1)
        heal = re.search(
            r"at its step (\d+) \((\d+) steps missed\): ([\d.]+) s, (\d+) bytes", drill.heal_line()
        )
        at, missed, seconds, size = heal.groups() if heal else ("-",) * 4
        lost = sorted(set(range(1, args.steps + 1)) - set(live.records))
        ok = [live.status, healed.status] == [0, 0] and drill.identical and not lost
        rows.append(
            (k, len(alone), at, missed, seconds, size, drill.identical, len(lost), f"{drill.seconds:.0f}", ok)
        )
    header = (
        "kill step",
        "quorum-1 steps",
        "healed at",
        "missed",
        "heal s",
        "heal bytes",
        "identical",
        "lost steps",
        "wall s",
        "ok",
    )
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(map(str, row)) + " |")
    print(f"{sum(not r[-1] for r in rows)} wrong of {len(rows)}")


if __name__ == "__main__":
    main()
