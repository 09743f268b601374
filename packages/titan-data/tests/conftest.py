"""Shared test inputs: the bundled corpus and tokenizers, and corpora laid out the way users keep them."""

import gzip
import json
import os
import sys
from pathlib import Path

import pytest

# Nothing in these tests may reach the network: the Hugging Face libraries must fail rather than download.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
# Helper modules beside the tests (the loopback hub server) import by name under --import-mode=importlib.
sys.path.insert(0, str(Path(__file__).parent))

from titan_data import build_tokenizer  # noqa: E402
from titan_data.datasets.registry import ASSETS  # noqa: E402

CORPUS = ASSETS / "c4_test" / "c4_test.jsonl"


def _write_c4_layout(root: Path, texts: list[str], num_files: int, split: str = "train") -> Path:
    """`texts` as gzipped C4 JSON lines under root/en/, named as on the hub (1024 train, 8 validation files)."""
    total = {"train": 1024, "validation": 8}[split]
    (root / "en").mkdir(parents=True, exist_ok=True)
    for f in range(num_files):
        with gzip.open(
            root / "en" / f"c4-{split}.{f:05d}-of-{total:05d}.json.gz", "wt", encoding="utf-8"
        ) as out:
            for i, text in enumerate(texts[f::num_files]):
                record = {
                    "text": text,
                    "timestamp": "2019-04-25T12:57:54Z",
                    "url": f"https://example.com/{f}/{i}",
                }
                out.write(json.dumps(record) + "\n")
    return root


def pytest_configure(config):
    # torchdata's StatefulDataLoader calls a deprecated torch API on every iterator; not ours to fix
    config.addinivalue_line("filterwarnings", "ignore:'set_vital' is deprecated:UserWarning")


@pytest.fixture(scope="session")
def corpus() -> list[str]:
    """The 2000 texts of the bundled c4_test corpus, in order."""
    return [json.loads(line)["text"] for line in CORPUS.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="session")
def write_c4_layout():
    """Write texts as gzipped C4 JSON lines under root/en/, named as on the hub."""
    return _write_c4_layout


@pytest.fixture(scope="session")
def llama3_tokenizer():
    return build_tokenizer(ASSETS / "tokenizer")


@pytest.fixture(scope="session")
def c4_texts(corpus) -> list[str]:
    """240 documents of the bundled corpus, each made unique by its number."""
    return [f"c4 document {i}: {text}" for i, text in enumerate(corpus[:240])]


@pytest.fixture(scope="session")
def c4_folder(tmp_path_factory, c4_texts) -> Path:
    """`c4_texts` in 12 hub-style C4 train files: file f holds documents f, f + 12, ..."""
    return _write_c4_layout(tmp_path_factory.mktemp("c4"), c4_texts, 12)
