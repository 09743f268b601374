"""No silent start: every combination of `model.flavor`, `checkpoint.initial_load_in_hf`,
`checkpoint.initial_load_path` and `checkpoint.enable` loads the Hugging Face folder's weights or is refused
at start in one line; only a named flavor with nothing to load trains from scratch, as asked.

"Loads" is proved by the weights: the run trains one step at a learning rate of 1e-9 and exports in the
base's dtype (bf16), which rounds back to the base's own tensors exactly, where random weights would not.
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from titan_train.cli import run

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("hf_instruct", REPO / "tests" / "fixtures" / "hf_instruct.py")
hf_instruct = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf_instruct)

# (flavor, enable, initial_load_in_hf, initial_load_path set) -> "loads", "scratch" or a fragment of the refusal.
REFUSED_DISABLED = "is set but checkpoint.enable is false"
NOT_DCP = "is not a DCP checkpoint"
EXPECTED = {
    ("from_hf", False, False, False): "with checkpoint.enable false would train the Hugging Face shape",
    ("from_hf", False, False, True): REFUSED_DISABLED,
    ("from_hf", False, True, False): REFUSED_DISABLED,
    ("from_hf", False, True, True): REFUSED_DISABLED,
    ("from_hf", True, False, False): "holds no checkpoint and nothing else is loaded",
    ("from_hf", True, False, True): NOT_DCP,
    ("from_hf", True, True, False): "loads",
    ("from_hf", True, True, True): "loads",
    ("debugmodel", False, False, False): "scratch",
    ("debugmodel", False, False, True): REFUSED_DISABLED,
    ("debugmodel", False, True, False): REFUSED_DISABLED,
    ("debugmodel", False, True, True): REFUSED_DISABLED,
    ("debugmodel", True, False, False): "scratch",
    ("debugmodel", True, False, True): NOT_DCP,
    ("debugmodel", True, True, False): "is not llama3 debugmodel",
    ("debugmodel", True, True, True): "is not llama3 debugmodel",
}
CASES = list(itertools.product(("from_hf", "debugmodel"), (False, True), (False, True), (False, True)))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return hf_instruct.write_instruct_folder(tmp_path_factory.mktemp("start") / "base")


def test_every_combination_has_an_expected_outcome():
    assert sorted(EXPECTED) == sorted(CASES)


@pytest.mark.parametrize(("flavor", "enable", "in_hf", "with_path"), CASES)
def test_a_start_from_a_hugging_face_folder_loads_or_is_refused(
    tmp_path, base, caplog, flavor, enable, in_hf, with_path
):
    expected = EXPECTED[(flavor, enable, in_hf, with_path)]
    dump = tmp_path / "run"
    flags = [
        *("--job.dump_folder", str(dump), "--model.name", "llama3", "--model.flavor", flavor),
        *("--model.hf_assets_path", str(base), "--training.steps", "1", "--optimizer.lr", "1e-9"),
        *("--training.seq_len", "64", "--training.local_batch_size", "1", "--lr_scheduler.warmup_steps", "0"),
        *("--activation_checkpoint.mode", "none", "--metrics.disable_color_printing"),
    ]  # fmt: skip
    flags += [
        "--checkpoint.enable",
        str(enable).lower(),
        "--checkpoint.initial_load_in_hf",
        str(in_hf).lower(),
    ]
    flags += ["--checkpoint.initial_load_path", str(base)] if with_path else []
    flags += ["--checkpoint.last_save_in_hf"] if enable and flavor == "from_hf" else []
    with caplog.at_level(logging.ERROR):
        rc = run(flags)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    if expected in ("loads", "scratch"):
        assert (rc, errors) == (0, [])
    else:
        assert rc == 2 and len(errors) == 1 and "\n" not in errors[0] and expected in errors[0], errors
        return
    if expected == "loads":
        exported = {}
        for shard in (dump / "checkpoint" / "step-1").glob("model-*.safetensors"):
            exported |= load_file(shard)
        original = load_file(base / "model.safetensors")
        assert sorted(exported) == sorted(original)
        for name, tensor in original.items():
            assert torch.equal(exported[name], tensor), name
