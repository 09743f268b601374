import sys
from pathlib import Path

# The toy model lives beside the torchrun workers, which import it as a sibling script.
sys.path.insert(0, str(Path(__file__).parent / "workers"))
