"""The remote link's tunables: part and range sizes, requests in flight, retries and timeouts (``PERSIST_REMOTE_*``),
each validated as :mod:`persist_core._knobs` validates the rest.
"""

from __future__ import annotations

from persist_core._knobs import PAGE_BYTES, _env_int
from persist_core.errors import ConfigError


def remote_part_bytes() -> int:
    """Multipart part size for object-store uploads: ``PERSIST_REMOTE_PART_BYTES`` (>= 5 MiB, S3's minimum).

    Raised per object when needed to stay within S3's 10,000 parts.
    """
    return _env_int("PERSIST_REMOTE_PART_BYTES", 16 << 20, minimum=5 << 20, what=" (S3's smallest part)")


#: the most requests in flight per file (``remote_concurrency``): 512 x 88 MB/s is 45 GB/s, four 100 Gb/s links
MAX_REMOTE_CONCURRENCY = 512


def remote_concurrency() -> int:
    """Concurrent part uploads / ranged downloads per file: ``PERSIST_REMOTE_CONCURRENCY`` (>= 1, default 8)."""
    return _env_int("PERSIST_REMOTE_CONCURRENCY", 8, minimum=1, maximum=MAX_REMOTE_CONCURRENCY)


def check_remote_concurrency(value: object) -> int:
    """``remote_concurrency`` checked (``None``: :func:`remote_concurrency`)."""
    if value is None:
        return remote_concurrency()
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_REMOTE_CONCURRENCY:
        raise ConfigError(f"remote_concurrency={value!r} must be an int from 1 to {MAX_REMOTE_CONCURRENCY}: the "
                          "requests in flight per file, about one per 85-90 MB/s of the link (16 for 10 Gb/s)")
    return value


def remote_read_bytes() -> int:
    """Bytes per ranged read of a restore or download from the remote: ``PERSIST_REMOTE_READ_BYTES`` (multiple
    of 4 KiB, default 64 MiB: fewer, larger requests; against the moto server here 32 MiB reads streamed at
    0.5x of boto3's download, 64 MiB at 0.8-1.1x)."""
    return _env_int("PERSIST_REMOTE_READ_BYTES", 64 << 20, minimum=PAGE_BYTES, multiple=PAGE_BYTES)


#: the least a ranged read or an upload part is made when a file is split among the connections (AWS's SDKs use
#: 8 MiB parts: smaller ones spend the link on requests)
MIN_SPLIT_BYTES = 8 << 20


def remote_span_bytes(size: int, concurrency: int, most: int | None = None) -> int:
    """Bytes per ranged read (or upload part) of a file of ``size`` bytes with ``concurrency`` requests in flight:
    ``most`` (default :func:`remote_read_bytes`) at most, and less where that leaves connections without a request
    (``size / concurrency``, but never under :data:`MIN_SPLIT_BYTES`), rounded up to 1 MiB. A 256 MiB shard read
    in 64 MiB pieces kept 4 of 8 connections busy; the link's rate needs all of them."""
    most = remote_read_bytes() if most is None else most
    share = -(-max(size, 1) // max(concurrency, 1))
    share = -(-share // (1 << 20)) * (1 << 20)
    return max(min(most, max(share, MIN_SPLIT_BYTES)), 1)


def remote_retries() -> int:
    """Attempts per remote operation before that checkpoint's upload fails: ``PERSIST_REMOTE_RETRIES`` (>= 1)."""
    return _env_int("PERSIST_REMOTE_RETRIES", 5, minimum=1, what=" (attempts, the first included)")


def remote_io_timeout_s() -> int:
    """Seconds one request to an object store may wait on the network before it fails and is retried:
    ``PERSIST_REMOTE_IO_TIMEOUT_S`` (>= 1, default 20; connecting: half of it, at least 1). A connection a
    proxy or NAT left half-open then costs seconds, not the client's minutes (``storage_options``'
    ``config_kwargs`` ``read_timeout``/``connect_timeout`` win when given)."""
    return _env_int("PERSIST_REMOTE_IO_TIMEOUT_S", 20, minimum=1, what=" (seconds)")


def remote_backoff_s() -> float:
    """First retry delay in seconds, doubled each attempt: ``PERSIST_REMOTE_BACKOFF_MS`` (>= 0, default 200)."""
    return _env_int("PERSIST_REMOTE_BACKOFF_MS", 200, minimum=0) / 1000
