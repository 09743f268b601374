"""torchft's lighthouse: where it is (`TORCHFT_LIGHTHOUSE`), whether it answers, and starting one.

The lighthouse is the one process every replica group talks to; a run that cannot reach it would wait
out torchft's connect timeout and fail deep in a thread, so it is checked before the run joins its group.
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

from titan_train.errors import ConfigError

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"


def lighthouse_address() -> str:
    """The lighthouse's address from the environment, or a ConfigError saying how to give one."""
    address = os.environ.get(LIGHTHOUSE_ENV, "")
    if not address:
        raise ConfigError(
            f"fault_tolerance.enable: {LIGHTHOUSE_ENV} is not set; start a lighthouse (torchft_lighthouse "
            f"--min_replicas 1, or apps/run_train.sh does) and export {LIGHTHOUSE_ENV}=http://HOST:29510"
        )
    return address


def check_lighthouse(timeout_seconds: float = 10.0) -> str:
    """Raise ConfigError unless the lighthouse named in the environment accepts a connection; return its address."""
    address = lighthouse_address()
    url = urlparse(address if "://" in address else f"http://{address}")
    if url.hostname is None or url.port is None:
        raise ConfigError(f"{LIGHTHOUSE_ENV}={address!r} is not an address; give http://HOST:PORT")
    try:
        socket.create_connection((url.hostname, url.port), timeout=timeout_seconds).close()
    except OSError as err:
        raise ConfigError(
            f"{LIGHTHOUSE_ENV}={address}: the torchft lighthouse cannot be reached ({err.strerror or err}); "
            "start it (torchft_lighthouse --min_replicas 1 --bind [::]:PORT) or fix the address"
        ) from None
    return address


def start_lighthouse(min_replicas: int = 1, *, join_timeout_ms: int = 1000, heartbeat_timeout_ms: int = 2000):
    """A lighthouse in this process on a free port (tests, benchmarks, one-machine runs); `.address()`
    is its address for `TORCHFT_LIGHTHOUSE`, `.shutdown()` stops it."""
    from torchft.coordination import LighthouseServer

    return LighthouseServer(
        bind="[::]:0",
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )
