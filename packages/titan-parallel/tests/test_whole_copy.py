"""`fill_whole`: a tensor-parallel model's weights gathered whole into its unparallelised copy (generation's model
under TP and EP in titan-train). Two gloo ranks split a toy model column- and row-wise (workers/whole_copy.py);
the copy holds the model's starting weights exactly, keeps its tied output weight tied and its buffer, and
computes what the unsplit model computes. Seen failing (2026-12-03): a first fill_whole that wrapped the gathered
tensor in a new Parameter per name (not per tensor) untied the output weight and failed the tie check."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from whole_copy import Toy

from titan_parallel import ModelDescriptionError, fill_whole

WORKER = Path(__file__).parent / "workers" / "whole_copy.py"


def test_a_tensor_parallel_models_copy_holds_its_whole_weights_tied_and_computes_as_it(tmp_path):
    out = tmp_path / "result.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    done = subprocess.run([*command, str(WORKER), str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    want = {"weights": True, "tied": True, "buffer": True, "eval": True, "same_output": True}
    assert json.loads(out.read_text()) == want


def test_a_copy_with_a_weight_the_model_lacks_is_refused_naming_it():
    with torch.device("meta"):
        target = Toy(extra=True)
    with pytest.raises(ModelDescriptionError, match="missing.weight of the unparallelised model"):
        fill_whole(target, Toy())
