"""A stand-in for the Hugging Face hub on 127.0.0.1 that serves small C4-layout files and misbehaves
on demand: it cuts responses off mid-file, ignores Range requests, or goes down for good.

It answers the two requests Titan makes: `/datasets/allenai/c4/resolve/main/en/<file>` (with Range) and
the file listing `/api/datasets/allenai/c4/tree/main/en` (sizes and LFS sha256, paginated by a Link
header as the hub does). Files are made on first request from `texts`, so the 1,024 train names all
exist without writing 1,024 files. It stops by itself after `max_requests` or `lifetime_s`.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

PREFIX = "/datasets/allenai/c4/resolve/main/"
TREE = "/api/datasets/allenai/c4/tree/main/en"
SPLIT_FILES = {"train": 1024, "validation": 8}


@contextlib.contextmanager
def unreachable_endpoint() -> Iterator[str]:
    """An HF_ENDPOINT on 127.0.0.1 that refuses every connection: a port held bound but never listening,
    so no server started meanwhile can take it."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{held.getsockname()[1]}"


def c4_file_bytes(texts: list[str], split: str, index: int, docs_per_file: int) -> bytes:
    """File `index` of `split`: `docs_per_file` records cycling through `texts`, gzipped."""
    start = (index * docs_per_file + (7 if split == "validation" else 0)) % len(texts)
    lines = []
    for i in range(docs_per_file):
        text = texts[(start + i) % len(texts)]
        lines.append(
            json.dumps(
                {
                    "text": f"{split} {index}.{i}: {text}",
                    "timestamp": "2019-04-25T12:57:54Z",
                    "url": f"https://example.com/{split}/{index}/{i}",
                }
            )
        )
    return gzip.compress(("\n".join(lines) + "\n").encode(), compresslevel=6, mtime=0)


class C4HubServer:
    """Serve C4-layout files on 127.0.0.1 (a free port); `url` is the HF_ENDPOINT to point clients at.

    Faults: `cut[name]` is a list of byte counts; each GET of that file takes the next one and sends only
    that many body bytes before closing. `ignore_range` answers every GET with the whole file (status
    200). `down_after_bytes` serves that many body bytes in total, then closes every connection unanswered
    (the source stays down). `listed` are the files per split the listing shows.
    """

    def __init__(
        self,
        texts: list[str],
        *,
        docs_per_file: int = 40,
        listed: dict[str, int] | None = None,
        page_size: int = 1000,
        max_requests: int = 20_000,
        lifetime_s: float = 300.0,
    ):
        self.texts, self.docs_per_file, self.page_size = texts, docs_per_file, page_size
        self.listed = listed or {"train": 4, "validation": 2}
        self.cut: dict[str, list[int]] = {}
        self.ignore_range = False
        self.down_after_bytes: int | None = None
        self.corrupt: set[str] = set()
        self.served_bytes = 0
        self.requests: list[tuple[str, str]] = []  # (path, Range header)
        self.max_requests = max_requests
        self._files: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._timer = threading.Timer(lifetime_s, self.stop)
        self._timer.daemon = True

    def __enter__(self) -> C4HubServer:
        self._thread.start()
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._timer.cancel()
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()

    def file(self, name: str) -> bytes:
        """The bytes of hub path `name` (en/c4-train.00000-of-01024.json.gz), made on first use."""
        with self._lock:
            if name not in self._files:
                split, rest = name.removeprefix("en/c4-").split(".", 1)
                index = int(rest.split("-of-")[0])
                if split not in SPLIT_FILES or not 0 <= index < SPLIT_FILES[split]:
                    raise KeyError(name)
                self._files[name] = c4_file_bytes(self.texts, split, index, self.docs_per_file)
            return self._files[name]

    def listing(self) -> list[dict]:
        entries = []
        for split, count in self.listed.items():
            for index in range(count):
                name = f"en/c4-{split}.{index:05d}-of-{SPLIT_FILES[split]:05d}.json.gz"
                data = self.file(name)
                entries.append(
                    {
                        "type": "file",
                        "path": name,
                        "size": len(data),
                        "oid": hashlib.sha1(data).hexdigest(),
                        "lfs": {
                            "oid": hashlib.sha256(data).hexdigest(),
                            "size": len(data),
                            "pointerSize": 134,
                        },
                    }
                )
        return entries

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                with hub._lock:
                    hub.requests.append((self.path, self.headers.get("Range", "")))
                    too_many = len(hub.requests) > hub.max_requests
                    down = hub.down_after_bytes is not None and hub.served_bytes >= hub.down_after_bytes
                if too_many or down:
                    self.close_connection = True
                    return  # no answer at all: the client sees the connection closed
                url = urlparse(self.path)
                if url.path == TREE:
                    return self._listing(int(parse_qs(url.query).get("cursor", ["0"])[0]))
                name = url.path.removeprefix(PREFIX)
                try:
                    data = hub.file(name) if url.path.startswith(PREFIX) else None
                except (KeyError, ValueError):
                    data = None
                if data is None:
                    return self.send_error(404, "Entry not found")
                if name in hub.corrupt:
                    data = data[:100] + bytes([data[100] ^ 0xFF]) + data[101:]
                start, end = 0, len(data)
                requested = self.headers.get("Range", "")
                if requested.startswith("bytes=") and not hub.ignore_range:
                    first, last = requested[6:].split("-")
                    start, end = int(first), min(end, int(last) + 1) if last else end
                    if start >= len(data):
                        return self.send_error(416)
                body = data[start:end]
                self.send_response(206 if start or (requested and not hub.ignore_range) else 200)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Accept-Ranges", "bytes")
                self.end_headers()
                with hub._lock:
                    cuts = hub.cut.get(name)
                    limit = cuts.pop(0) if cuts else len(body)
                    if hub.down_after_bytes is not None:
                        limit = min(limit, max(0, hub.down_after_bytes - hub.served_bytes))
                    hub.served_bytes += min(limit, len(body))
                try:
                    self.wfile.write(body[:limit])
                except OSError:
                    pass
                self.close_connection = True

            def _listing(self, cursor: int) -> None:
                entries = hub.listing()
                page = entries[cursor : cursor + hub.page_size]
                payload = json.dumps(page).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                if cursor + hub.page_size < len(entries):
                    self.send_header("Link", f'<{hub.url}{TREE}?cursor={cursor + hub.page_size}>; rel="next"')
                self.end_headers()
                self.wfile.write(payload)

        return Handler
