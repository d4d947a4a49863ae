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
