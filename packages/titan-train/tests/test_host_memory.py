import subprocess
import sys

import pytest

# Allocates, fills and frees 256 MiB four times and prints the minor page faults of the last round
# (the first ones settle the heap), with glibc's defaults and then after keep_freed_host_memory().
# With the defaults the freed block is unmapped each time and faults in again, as a training step's
# activations do.
PROBE = """
import resource
import torch
from titan_train.host_memory import keep_freed_host_memory

def last_round_faults():
    for _ in range(4):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.empty(2**26).fill_(1.0)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    return faults

default = last_round_faults()
applied = keep_freed_host_memory()
print(default, applied, last_round_faults())
"""


def test_freed_host_memory_is_reused_without_page_faults():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    default, applied, kept = out.stdout.split()
    assert applied == "True"
    if int(default) < 30_000:  # 256 MiB in 4 KiB pages is 65,536
        pytest.skip(f"this kernel maps the block back in large pages ({default} faults): nothing to remove")
    assert int(kept) < int(default) / 20
