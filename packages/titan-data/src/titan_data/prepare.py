"""`titan-data prepare`: copy C4 from the hub into a folder a run reads with `dataset_path`, on a node
with hub access (a login node), so compute nodes need no network.

Resumable and verified: each file downloads to `NAME.part`, continued with a Range request after an
interruption (or a dropped connection), and takes its final name only once its size and the sha256 the
hub lists for it (its Git LFS id) match. A rerun skips the files already there (`--verify` hashes them
again) and fetches only what is missing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from titan_data.datasets.c4 import (
    C4_NUM_FILES,
    C4_REPO,
    C4_REVISION,
    c4_file_name,
    hub_endpoint,
    hub_file_url,
)
from titan_data.datasets.http_files import TRANSIENT_ERRORS, RetryPolicy, stream_bytes
from titan_data.errors import DataError, SourceUnavailable

logger = logging.getLogger(__name__)

SPLITS = {"c4": "train", "c4_validation": "validation"}
_NEXT_PAGE = re.compile(r'<([^>]+)>;\s*rel="next"')


@dataclass(frozen=True)
class HubFile:
    """A file as the hub lists it: its path, size and sha256 (None when the hub gives no LFS id)."""

    path: str
    size: int
    sha256: str | None


def list_c4_files(endpoint: str, policy: RetryPolicy) -> dict[str, HubFile]:
    """Every file under allenai/c4's en/ with its size and sha256, from the hub's tree API (all pages)."""
    url: str | None = f"{endpoint}/api/datasets/{C4_REPO}/tree/{C4_REVISION}/en"
    files: dict[str, HubFile] = {}
    while url:
        try:
            with urllib.request.urlopen(url, timeout=policy.timeout_s) as response:
                entries = json.loads(response.read())
                found = _NEXT_PAGE.search(response.headers.get("Link", ""))
        except TRANSIENT_ERRORS as err:
            raise SourceUnavailable(
                f"prepare: the hub at {endpoint} did not list {C4_REPO} ({err}); run this on a node with hub "
                "access (HF_ENDPOINT names a mirror or proxy)"
            ) from None
        for entry in entries:
            if entry.get("type") == "file":
                lfs = entry.get("lfs") or {}
                files[entry["path"]] = HubFile(entry["path"], int(entry["size"]), lfs.get("oid"))
        url = found.group(1) if found else None
    return files


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _fetch(file: HubFile, url: str, dest: Path, policy: RetryPolicy, bar: tqdm) -> None:
    """Download `url` to `dest` through `dest.part`, continuing a part an earlier run left; verify it."""
    part = dest.with_name(dest.name + ".part")
    have = part.stat().st_size if part.exists() else 0
    if have > file.size:
        part.unlink()
        have = 0
    digest = hashlib.sha256()
    if have:
        with open(part, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
    with open(part, "ab") as out:
        for chunk in stream_bytes(url, policy, start=have) if have < file.size else ():
            out.write(chunk)
            digest.update(chunk)
            bar.update(len(chunk))
    size = part.stat().st_size
    if size != file.size or (file.sha256 is not None and digest.hexdigest() != file.sha256):
        part.unlink()
        raise DataError(
            f"prepare: {url} arrived as {size} bytes with sha256 {digest.hexdigest()}, but the hub lists "
            f"{file.size} bytes and sha256 {file.sha256}; the download was removed, run the same command again"
        )
    part.replace(dest)


def prepare_c4(
    dataset: str,
    output: str | Path,
    *,
    shards: int | None = None,
    verify: bool = False,
    policy: RetryPolicy | None = None,
    progress: bool = True,
) -> list[Path]:
    """Copy `dataset` (c4: the train split, or its first `shards` files; c4_validation) into `output`, laid
    out as on the hub; return the files. See the module for how it resumes and verifies."""
    if dataset not in SPLITS:
        raise DataError(f"prepare: '{dataset}' is not one of {', '.join(SPLITS)}")
    split = SPLITS[dataset]
    total = C4_NUM_FILES[split]
    count = total if shards is None else shards
    if not 1 <= count <= total:
        raise DataError(f"prepare: --shards must be between 1 and {total} for {dataset}, got {shards}")
    policy = policy or RetryPolicy.from_env()
    endpoint = hub_endpoint()
    listed = list_c4_files(endpoint, policy)
    wanted = [c4_file_name(split, i) for i in range(count)]
    missing = [name for name in wanted if name not in listed]
    if missing:
        raise DataError(
            f"prepare: the hub at {endpoint} does not list {missing[0]} (of {len(missing)} missing)"
        )
    output = Path(output)
    todo, present = [], 0
    for name in wanted:
        dest = output / name
        if dest.is_file() and dest.stat().st_size == listed[name].size:
            if not verify or listed[name].sha256 in (None, _sha256(dest)):
                present += listed[name].size
                continue
            logger.warning("prepare: %s does not match the hub's sha256; fetching it again", dest)
            dest.unlink()
        todo.append(name)
    partial = sum((output / f"{n}.part").stat().st_size for n in todo if (output / f"{n}.part").is_file())
    size = sum(listed[name].size for name in wanted)
    logger.info(
        "prepare: %s: %d of %d files already here; fetching %d",
        output,
        len(wanted) - len(todo),
        len(wanted),
        len(todo),
    )
    with tqdm(
        total=size,
        initial=present + partial,
        unit="B",
        unit_scale=True,
        desc=f"prepare {dataset}",
        disable=not progress,
    ) as bar:
        for name in todo:
            (output / name).parent.mkdir(parents=True, exist_ok=True)
            _fetch(listed[name], hub_file_url(name, endpoint), output / name, policy, bar)
    return [output / name for name in wanted]
