"""C4 (allenai/c4, English): where its files are and how a run reads them.

Three places, tried in this order: `dataset_path` (a copy laid out as on the hub, which `titan-data
prepare` writes), the Hugging Face cache when HF_DATASETS_OFFLINE or HF_HUB_OFFLINE is set, else the hub
itself (HF_ENDPOINT, default https://huggingface.co), streamed file by file over HTTP. All three read
the same files with the same positions, so a run can move from streaming to a local copy and resume.
"""

from __future__ import annotations

import os
from pathlib import Path

from titan_data.datasets.file_formats import FileSource
from titan_data.datasets.http_files import HttpJsonLinesSource
from titan_data.datasets.sources import TextSource
from titan_data.errors import DataError

C4_REPO = "allenai/c4"
C4_REVISION = "main"
# C4's English files as named on the hub: 1024 nearly equal train files, 8 validation files.
C4_NUM_FILES = {"train": 1024, "validation": 8}
DEFAULT_ENDPOINT = "https://huggingface.co"
PREPARE_FIX = (
    "on a node with hub access run `titan-data prepare {name} --output DIR` and set dataset_path = DIR, "
    "or set HF_DATASETS_OFFLINE=1 with the files in the Hugging Face cache"
)


def c4_file_name(split: str, index: int) -> str:
    """The hub path of file `index` of `split`: en/c4-train.00000-of-01024.json.gz, ..."""
    return f"en/c4-{split}.{index:05d}-of-{C4_NUM_FILES[split]:05d}.json.gz"


def c4_pattern(split: str) -> str:
    return f"en/c4-{split}.*-of-{C4_NUM_FILES[split]:05d}.json.gz"


def hub_endpoint() -> str:
    """The hub's base URL: HF_ENDPOINT (a mirror, a proxy, or a test server), else huggingface.co."""
    return os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/")


def hub_file_url(path: str, endpoint: str | None = None) -> str:
    return f"{endpoint or hub_endpoint()}/datasets/{C4_REPO}/resolve/{C4_REVISION}/{path}"


def hub_offline() -> bool:
    """Whether the Hugging Face libraries' offline switches are set (the same values they accept)."""
    return any(
        os.environ.get(name, "").upper() in {"1", "ON", "YES", "TRUE"}
        for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
    )


def hub_cache_snapshots() -> Path:
    """Where huggingface_hub keeps allenai/c4's downloaded files (HF_HUB_CACHE, else HF_HOME/hub)."""
    cache = (
        os.environ.get("HF_HUB_CACHE")
        or Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub"
    )
    return Path(cache) / f"datasets--{C4_REPO.replace('/', '--')}" / "snapshots"


def _cached_files(split: str) -> list[Path]:
    """Each C4 file of `split` in any cached snapshot, once (by name), in file order."""
    found: dict[str, Path] = {}
    for file in sorted(hub_cache_snapshots().glob(f"*/{c4_pattern(split)}")):
        found.setdefault(file.name, file)
    return [found[name] for name in sorted(found)]


def c4_source(name: str, split: str, path: str | Path | None) -> TextSource:
    """C4 English `split` from `path`, the offline cache, or streamed from the hub (see the module)."""
    fix = PREPARE_FIX.format(name=name)
    if path is not None:
        root = Path(path)
        files = sorted(root.glob(c4_pattern(split)))
        if not files:
            raise DataError(
                f"dataset: '{name}' found no C4 files under {root} (expected {root / c4_file_name(split, 0)} "
                f"and the like); {fix}"
            )
        return FileSource(name, files, formats=("json",), equal_shards=True, location=str(root))
    if hub_offline():
        files = _cached_files(split)
        if not files:
            raise DataError(
                f"dataset: '{name}': the hub is switched off (HF_DATASETS_OFFLINE/HF_HUB_OFFLINE) and the "
                f"Hugging Face cache {hub_cache_snapshots()} holds no {c4_pattern(split)}; {fix}"
            )
        return FileSource(
            name, files, formats=("json",), equal_shards=True, location=str(files[0].parents[1])
        )
    endpoint = hub_endpoint()
    urls = [hub_file_url(c4_file_name(split, i), endpoint) for i in range(C4_NUM_FILES[split])]
    return HubC4Source(name, urls, location=f"{endpoint}/datasets/{C4_REPO}", fix=fix)


class HubC4Source(HttpJsonLinesSource):
    """C4 streamed from the hub; `check()` turns an unreachable hub into one line with the fix."""

    def __init__(self, name: str, urls: list[str], *, location: str, fix: str, **kwargs):
        super().__init__(name, urls, location=location, **kwargs)
        self.fix = fix

    def check(self) -> None:
        try:
            super().check()
        except DataError as err:
            raise DataError(
                f"dataset: '{self.name}' streams {C4_REPO} from {hub_endpoint()}, but {err}; {self.fix}"
            ) from None
