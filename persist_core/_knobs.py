"""Tunables users should not need to touch, each overridable by an environment variable.

Read once per engine, at construction. Values are validated where they are used.
"""

from __future__ import annotations

import os

#: Alignment of the data section and of every O_DIRECT write (bytes).
PAGE_BYTES = 4096
#: Alignment of each tensor entry inside the data section (bytes); 64 divides every dtype size.
ENTRY_ALIGN_BYTES = 64


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer; unset it or give a number") from None


def write_threads() -> int:
    """Threads that write (and checksum) chunks of one shard in parallel: ``PERSIST_WRITE_THREADS``."""
    return _env_int("PERSIST_WRITE_THREADS", 4)


def chunk_bytes() -> int:
    """Size of one pwrite and of one checksummed chunk: ``PERSIST_CHUNK_BYTES`` (multiple of 4 KiB)."""
    return _env_int("PERSIST_CHUNK_BYTES", 32 << 20)


def direct_io() -> str:
    """``PERSIST_DIRECT_IO``: ``auto`` (try O_DIRECT, fall back), ``on`` or ``off``."""
    return os.environ.get("PERSIST_DIRECT_IO", "auto")


def remote_part_bytes() -> int:
    """Multipart part size for object-store uploads: ``PERSIST_REMOTE_PART_BYTES`` (default 16 MiB).

    Raised per object when needed to stay within S3's 10,000 parts.
    """
    return _env_int("PERSIST_REMOTE_PART_BYTES", 16 << 20)


def remote_concurrency() -> int:
    """Concurrent part uploads / ranged downloads per file: ``PERSIST_REMOTE_CONCURRENCY`` (default 8)."""
    return _env_int("PERSIST_REMOTE_CONCURRENCY", 8)


def remote_retries() -> int:
    """Attempts per remote operation before it fails for good: ``PERSIST_REMOTE_RETRIES`` (default 5)."""
    return _env_int("PERSIST_REMOTE_RETRIES", 5)


def remote_backoff_s() -> float:
    """First retry delay in seconds, doubled each attempt: ``PERSIST_REMOTE_BACKOFF_MS`` (default 200)."""
    return _env_int("PERSIST_REMOTE_BACKOFF_MS", 200) / 1000
