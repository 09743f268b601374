"""torchrun worker: `titan-train` with the flags given, the tiny MoE flavors registered first."""

import sys

import moe_balance_flavors  # noqa: F401  (registers the flavors: this script's folder is on sys.path)

from titan_train.cli import run

if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
