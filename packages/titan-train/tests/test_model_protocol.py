"""titan-train drives a model only through `titan_parallel.TrainableModel` and `nn.Module`'s own API.

The scan reads titan_train's source and looks at every attribute taken of an expression that holds a
model: a name `model`, `part` or `model_part`, an item of `parts` / `model_parts` (`built.parts[0]`),
or `self.model` / `loaded.model`. Each attribute must be an `nn.Module` or FSDP method, or a member of
the protocol or of an optional protocol beside it in titan_parallel.protocols; a model's own attributes (`freqs_cis`, `args`, `layers`) are reached for nowhere.
"""

import ast
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

import titan_ckpt
import titan_train
from titan_models import Transformer, llama3_args
from titan_parallel import TrainableModel, protocols

SOURCE = Path(titan_train.__file__).parent
MODEL_NAMES = {"model", "part", "model_part"}
PART_LISTS = {"parts", "model_parts"}
OWNERS_OF_A_MODEL = {"self", "loaded"}  # `self.model` (lm-eval's wrapper), `loaded.model` (a checkpoint's)


def _protocol_members() -> set[str]:
    """TrainableModel's members, and those of the optional protocols a model may also answer (asked with
    `isinstance` first: `HasQueryKeyHeads`, `HasMoELayers`, ...), all declared in titan_parallel.protocols."""
    classes = set(TrainableModel.__mro__) | {
        cls
        for cls in vars(protocols).values()
        if isinstance(cls, type) and getattr(cls, "_is_protocol", False)
    }
    members = set()
    for cls in classes:
        members |= {name for name in vars(cls) if not name.startswith("_")}
    return members


# `training` is nn.Module's own flag, set on the instance by its __init__ (so not in dir(nn.Module)).
ALLOWED = set(dir(nn.Module)) | {"training"} | set(dir(FSDPModule)) | _protocol_members()


def _holds_a_model(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in MODEL_NAMES
    if isinstance(node, ast.Subscript):
        items = node.value
        return (isinstance(items, ast.Name) and items.id in PART_LISTS) or (
            isinstance(items, ast.Attribute) and items.attr in PART_LISTS
        )
    if isinstance(node, ast.Attribute):
        return (
            node.attr == "model" and isinstance(node.value, ast.Name) and node.value.id in OWNERS_OF_A_MODEL
        )
    return False


def model_attributes_outside_the_protocol(source: str, where: str) -> list[str]:
    """`where:line: expression` for each attribute of a model that is neither nn.Module's nor the protocol's."""
    return [
        f"{where}:{node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute) and _holds_a_model(node.value) and node.attr not in ALLOWED
    ]


def test_titan_train_reaches_no_model_attribute_outside_the_protocol():
    found = [
        hit
        for path in sorted(SOURCE.rglob("*.py"))
        for hit in model_attributes_outside_the_protocol(path.read_text(), str(path.relative_to(SOURCE)))
    ]
    assert not found, (
        "titan_train reaches into a model; add what it needs to titan_parallel.protocols:\n"
        + "\n".join(found)
    )


ADAPTER_NAMES = {"adapter", "hf_adapter"}
NAMED_READS = {"getattr", "hasattr"}


def members_read_by_name(source: str, where: str) -> list[str]:
    """`where:line: call` for each `getattr`/`hasattr` of a model or an HF adapter by a member's name: an
    optional member is declared on a protocol (titan_parallel.protocols, titan_ckpt's HasUnheldState, ...)
    and asked for with isinstance, so that a renamed member breaks loudly instead of reading the default."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in NAMED_READS
        ):
            continue
        if len(node.args) < 2 or not isinstance(node.args[1], ast.Constant):
            continue
        target = node.args[0]
        if _holds_a_model(target) or (isinstance(target, ast.Name) and target.id in ADAPTER_NAMES):
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_model_or_adapter_member_is_read_by_name():
    sources = [SOURCE, Path(titan_ckpt.__file__).parent]
    found = [
        hit
        for root in sources
        for path in sorted(root.rglob("*.py"))
        for hit in members_read_by_name(path.read_text(), str(path.relative_to(root.parent)))
    ]
    assert not found, "declare the optional member on a protocol and ask with isinstance:\n" + "\n".join(
        found
    )


@pytest.mark.parametrize(
    "line",
    [
        'args = getattr(parts[0], "args", None)',
        'unheld = tuple(getattr(adapter, "hf_unheld_state", ()))',
        'if hasattr(model, "moe_layers"): pass',
    ],
)
def test_the_scan_sees_a_member_read_by_name(line):
    assert members_read_by_name(line, "planted.py")


@pytest.mark.parametrize(
    "line",
    [
        "table = model.freqs_cis",
        "cp = [part.freqs_cis for part in self.model_parts]",
        "n = built.parts[0].args.n_layers",
        "device = self.model.tok_embeddings.weight.device",
    ],
)
def test_the_scan_sees_a_model_attribute_outside_the_protocol(line):
    assert model_attributes_outside_the_protocol(line, "planted.py")


def test_the_scan_lets_the_protocol_and_module_api_pass():
    source = (
        "part.sequence_buffers(); model.init_weights(seed=0); part.to_empty(device='cpu'); config.model.name"
    )
    assert model_attributes_outside_the_protocol(source, "allowed.py") == []


def test_titan_models_transformer_is_a_trainable_model():
    with torch.device("meta"):
        model = Transformer(llama3_args("debugmodel"))
    assert isinstance(model, TrainableModel)
    ((table, dim),) = model.sequence_buffers()
    assert table is model.freqs_cis and dim == 0
