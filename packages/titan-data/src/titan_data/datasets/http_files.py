"""Gzipped JSON-lines files read over HTTP, surviving dropped connections without losing their place.

A dropped connection mid-file is retried with backoff and resumed with a `Range` request at the
compressed byte it stopped at, feeding the same decompressor: the documents that come out are exactly
those of an undisturbed read, so a loader's saved position stays exact. Only when the retries run out
(the source stays down) does reading stop, with `SourceUnavailable`.

The positions are those of local JSON lines (`file_formats.py`): (file number, decompressed byte
offset). A run streamed from the hub can therefore resume from a local copy of the same files.
"""

from __future__ import annotations

import http.client
import logging
import os
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from titan_data.datasets.file_formats import decode_json_line
from titan_data.datasets.sources import DocumentReader, TextSource
from titan_data.errors import DataError, SourceUnavailable

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 16
# Statuses a busy or restarting server answers with; anything else (404, 403) will not change on retry.
TRANSIENT_STATUSES = {408, 425, 429, 500, 502, 503, 504}
TRANSIENT_ERRORS = (urllib.error.URLError, http.client.HTTPException, OSError)


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to try before calling a source unavailable: `attempts` tries in a row without progress,
    waiting `backoff_s`, doubled each time up to `max_backoff_s`; `timeout_s` per connect or read.

    The defaults ride out about five minutes of outage. `from_env` reads TITAN_DATA_HTTP_ATTEMPTS,
    TITAN_DATA_HTTP_BACKOFF_S, TITAN_DATA_HTTP_MAX_BACKOFF_S and TITAN_DATA_HTTP_TIMEOUT_S.
    """

    attempts: int = 10
    backoff_s: float = 1.0
    max_backoff_s: float = 60.0
    timeout_s: float = 60.0

    @classmethod
    def from_env(cls) -> RetryPolicy:
        names = {
            "attempts": "ATTEMPTS",
            "backoff_s": "BACKOFF_S",
            "max_backoff_s": "MAX_BACKOFF_S",
            "timeout_s": "TIMEOUT_S",
        }
        values: dict[str, Any] = {}
        for field_name, suffix in names.items():
            raw = os.environ.get(f"TITAN_DATA_HTTP_{suffix}")
            if raw is None:
                continue
            try:
                values[field_name] = int(raw) if field_name == "attempts" else float(raw)
            except ValueError:
                raise DataError(f"TITAN_DATA_HTTP_{suffix}={raw!r} is not a number") from None
        return cls(**values)

    def wait(self, failures: int) -> float:
        return min(self.backoff_s * 2 ** (failures - 1), self.max_backoff_s)


def _describe(err: BaseException) -> str:
    if isinstance(err, urllib.error.HTTPError):
        return f"HTTP {err.code}"
    reason = getattr(err, "reason", None)
    return f"{type(err).__name__}: {reason or err}"


def stream_bytes(url: str, policy: RetryPolicy, start: int = 0) -> Iterator[bytes]:
    """The bytes of `url` from `start`, resumed with a Range request after each dropped connection.

    A server that ignores the range (status 200) is read again from the start and the bytes already
    seen are dropped. Raises SourceUnavailable after `policy.attempts` failures in a row with no byte
    received, and DataError for a status that retrying cannot change (404, say).
    """
    received, failures = start, 0
    while True:
        try:
            headers = {"Range": f"bytes={received}-"} if received else {}
            with urllib.request.urlopen(
                urllib.request.Request(url, headers=headers), timeout=policy.timeout_s
            ) as r:
                drop = received if (received and r.status == 200) else 0
                length = r.headers.get("Content-Length")
                expected = received - drop + int(length) if length is not None else None
                at = received - drop
                while chunk := r.read(CHUNK_BYTES):
                    at += len(chunk)
                    if drop:
                        kept = chunk[drop:]
                        drop = max(0, drop - len(chunk))
                        chunk = kept
                    if chunk:
                        received, failures = at, 0
                        yield chunk
                if expected is not None and at < expected:
                    raise http.client.IncompleteRead(b"", expected - at)
                return
        except urllib.error.HTTPError as err:
            if err.code == 416 and received:  # asked for bytes past the end: everything is here
                return
            if err.code not in TRANSIENT_STATUSES:
                raise DataError(f"dataset: {url} answered HTTP {err.code} ({err.reason})") from None
            failure = err
        except TRANSIENT_ERRORS as err:
            failure = err
        failures += 1
        if failures > policy.attempts:
            raise SourceUnavailable(
                f"dataset: {url} stopped answering ({_describe(failure)}) at byte {received}, and "
                f"{policy.attempts} retries over {_total_wait(policy):.0f} s did not bring it back"
            )
        logger.warning(
            "dataset: %s dropped at byte %d (%s); retry %d of %d in %.1f s",
            url,
            received,
            _describe(failure),
            failures,
            policy.attempts,
            policy.wait(failures),
        )
        time.sleep(policy.wait(failures))


def _total_wait(policy: RetryPolicy) -> float:
    return sum(policy.wait(n) for n in range(1, policy.attempts + 1))


def read_gzip_lines(
    url: str, start: int, policy: RetryPolicy
) -> Iterator[tuple[tuple[str, int, bytes], int]]:
    """((url, offset, line), next offset) for each non-blank line of a gzipped file from decompressed
    byte `start` on, as `file_formats.read_lines` yields for a local file."""
    decompressor = zlib.decompressobj(zlib.MAX_WBITS | 16)
    offset, pending = 0, b""
    for chunk in stream_bytes(url, policy):
        data = decompressor.decompress(chunk)
        while decompressor.eof and decompressor.unused_data:  # a file of several gzip members
            rest = decompressor.unused_data
            decompressor = zlib.decompressobj(zlib.MAX_WBITS | 16)
            data += decompressor.decompress(rest)
        lines = (pending + data).split(b"\n")
        pending = lines.pop()
        for line in lines:
            record_at, offset = offset, offset + len(line) + 1
            if record_at >= start and line and not line.isspace():
                yield (url, record_at, line), offset
    if not decompressor.eof:
        raise SourceUnavailable(f"dataset: {url} ended before its gzip stream did (a truncated file)")
    if pending and not pending.isspace() and offset >= start:
        yield (url, offset, pending), offset + len(pending)


class HttpJsonLinesSource(TextSource):
    """Gzipped JSON lines at `urls`, one shard per file, read in order over HTTP."""

    remote = True

    def __init__(
        self,
        name: str,
        urls: list[str],
        *,
        location: str,
        policy: RetryPolicy | None = None,
        equal_shards: bool = True,
        text_field: str = "text",
    ):
        self.name, self.urls, self.location = name, list(urls), location
        self.policy = policy or RetryPolicy.from_env()
        self.equal_shards, self.text_field = equal_shards, text_field

    @property
    def num_shards(self) -> int:
        return len(self.urls)

    def shard(self, num_shards: int, index: int) -> HttpJsonLinesSource:
        return HttpJsonLinesSource(
            self.name,
            self.urls[index::num_shards],
            policy=self.policy,
            equal_shards=self.equal_shards,
            location=f"{self.location} (shard {index} of {num_shards})",
            text_field=self.text_field,
        )

    def open(self, position: Any = None) -> DocumentReader:
        at = list(position or (0, 0))
        text_field = self.text_field

        def records() -> Iterator[tuple[str, int, bytes]]:
            while at[0] < len(self.urls):
                for record, next_offset in read_gzip_lines(self.urls[at[0]], at[1], self.policy):
                    at[1] = next_offset  # before the yield: position() then points past this document
                    yield record
                at[0], at[1] = at[0] + 1, 0

        return DocumentReader(records(), lambda: (at[0], at[1]), lambda r: decode_json_line(r, text_field))

    def check(self) -> None:
        """Ask for the first byte of the first file (a few quick tries): a source that cannot be
        reached is found at start, not at the first batch."""
        quick = RetryPolicy(
            attempts=min(self.policy.attempts, 2),
            backoff_s=min(self.policy.backoff_s, 0.5),
            timeout_s=min(self.policy.timeout_s, 20),
        )
        request = urllib.request.Request(self.urls[0], headers={"Range": "bytes=0-0"})
        for attempt in range(quick.attempts + 1):
            try:
                with urllib.request.urlopen(request, timeout=quick.timeout_s):
                    return
            except urllib.error.HTTPError as err:
                if err.code not in TRANSIENT_STATUSES or attempt == quick.attempts:
                    raise SourceUnavailable(f"{self.urls[0]} answered {_describe(err)}") from None
            except TRANSIENT_ERRORS as err:
                if attempt == quick.attempts:
                    raise SourceUnavailable(f"{self.urls[0]} cannot be reached ({_describe(err)})") from None
            time.sleep(quick.wait(attempt + 1))
