"""Shared set-up for titan-models' tests."""

import sys
from pathlib import Path

# Helpers shared by test modules (family_checks) import by name under --import-mode=importlib.
sys.path.insert(0, str(Path(__file__).parent))
