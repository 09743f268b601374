"""lm-eval on a tokenizer that declares no BOS (Qwen's `"bos_token": null`): Titan's wrapper frames
contexts as lm-eval's own `hf` backend does for such a tokenizer, with the end-of-text id as the prefix
token and no BOS in front."""

import json
import re

import pytest
from torch import nn

from titan_data import DataError, build_tokenizer
from titan_data.datasets.registry import ASSETS


def test_a_tokenizer_without_bos_scores_with_eos_as_prefix_and_no_bos(tmp_path):
    pytest.importorskip("lm_eval")
    from titan_train.commands.lm_eval_model import TitanLM

    data = json.loads((ASSETS / "tokenizer" / "tokenizer.json").read_text())
    data["post_processor"] = None
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": None, "eos_token": "<|im_end|>"})
    )
    with pytest.raises(DataError, match=re.escape("names eos_token '<|im_end|>', which")):
        build_tokenizer(tmp_path)  # the bundled vocabulary has no <|im_end|>: named in one line
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": None, "eos_token": "<|eot_id|>"})
    )
    tokenizer = build_tokenizer(tmp_path)
    lm = TitanLM(nn.Linear(1, 1), tokenizer, max_length=64)
    # lm-eval's hf backend: `bos_token_id if not None else eot_token_id`
    assert lm.prefix_token_id == lm.eot_token_id == tokenizer.eos_id
    assert lm.tok_encode("hello world") == tokenizer.encode("hello world")
    assert tokenizer.bos_id is None and 1792 not in lm.tok_encode("<|begin_of_text|> hi")
