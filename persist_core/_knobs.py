"""Every tunable, validated here: environment overrides users should not need, and the engine's settings.

Each ``PERSIST_*`` variable is read once per engine (or remote tier), at construction, and a
bad value is a :class:`~persist_core.errors.ConfigError` naming the variable and its range.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from persist_core.errors import ConfigError
from persist_core.layout import is_url

#: Alignment of the data section and of every O_DIRECT write (bytes).
PAGE_BYTES = 4096
#: Alignment of each tensor entry inside the data section (bytes); 64 divides every dtype size.
ENTRY_ALIGN_BYTES = 64


def _env_int(name: str, default: int, *, minimum: int, multiple: int = 1, what: str = "") -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < minimum or value % multiple:
        rule = f"an integer >= {minimum}" + (f" and a multiple of {multiple}" if multiple > 1 else "")
        raise ConfigError(f"environment variable {name}={raw!r} must be {rule}{what}; unset it for the default "
                          f"({default})")
    return value


def write_threads() -> int:
    """Threads that write (and checksum) chunks of one shard in parallel: ``PERSIST_WRITE_THREADS`` (>= 1)."""
    return _env_int("PERSIST_WRITE_THREADS", 4, minimum=1)


def chunk_bytes() -> int:
    """Size of one pwrite and of one checksummed chunk: ``PERSIST_CHUNK_BYTES`` (multiple of 4 KiB)."""
    return _env_int("PERSIST_CHUNK_BYTES", 32 << 20, minimum=PAGE_BYTES, multiple=PAGE_BYTES)


def direct_io() -> str:
    """``PERSIST_DIRECT_IO``: ``auto`` (try O_DIRECT, fall back), ``on`` or ``off``."""
    value = os.environ.get("PERSIST_DIRECT_IO", "auto").strip() or "auto"
    if value not in ("auto", "on", "off"):
        raise ConfigError(f"environment variable PERSIST_DIRECT_IO={value!r} must be 'auto', 'on' or 'off'")
    return value


def remote_part_bytes() -> int:
    """Multipart part size for object-store uploads: ``PERSIST_REMOTE_PART_BYTES`` (>= 5 MiB, S3's minimum).

    Raised per object when needed to stay within S3's 10,000 parts.
    """
    return _env_int("PERSIST_REMOTE_PART_BYTES", 16 << 20, minimum=5 << 20, what=" (S3's smallest part)")


def remote_concurrency() -> int:
    """Concurrent part uploads / ranged downloads per file: ``PERSIST_REMOTE_CONCURRENCY`` (>= 1, default 8)."""
    return _env_int("PERSIST_REMOTE_CONCURRENCY", 8, minimum=1)


def remote_read_bytes() -> int:
    """Bytes per ranged read of a restore or download from the remote: ``PERSIST_REMOTE_READ_BYTES`` (multiple
    of 4 KiB, default 64 MiB: fewer, larger requests; against the moto server here 32 MiB reads streamed at
    0.5x of boto3's download, 64 MiB at 0.8-1.1x)."""
    return _env_int("PERSIST_REMOTE_READ_BYTES", 64 << 20, minimum=PAGE_BYTES, multiple=PAGE_BYTES)


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


_env_write_threads, _env_chunk_bytes, _env_direct_io = write_threads, chunk_bytes, direct_io


@dataclass(frozen=True, kw_only=True)
class WriteSettings:
    """How an engine writes: the constructor's arguments, else the environment's, validated."""

    write_threads: int
    chunk_bytes: int
    direct_io: str
    max_pending: int
    verify: bool
    remote_timeout_s: float = 300.0
    max_unsynced_bytes: int | None = None

    @classmethod
    def resolve(cls, *, write_threads: int | None, chunk_bytes: int | None, direct_io: str | None, max_pending: int,
                verify: bool, remote_timeout_s: float = 300.0, max_unsynced_bytes: int | None = None) -> WriteSettings:
        return cls(write_threads=_env_write_threads() if write_threads is None else write_threads,
                   chunk_bytes=_env_chunk_bytes() if chunk_bytes is None else chunk_bytes,
                   direct_io=_env_direct_io() if direct_io is None else direct_io,
                   max_pending=max_pending, verify=verify, remote_timeout_s=remote_timeout_s,
                   max_unsynced_bytes=max_unsynced_bytes)

    def __post_init__(self) -> None:
        def whole(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not whole(self.write_threads) or self.write_threads < 1:
            raise ConfigError(f"write_threads={self.write_threads!r} must be at least 1")
        if not whole(self.chunk_bytes) or self.chunk_bytes < PAGE_BYTES or self.chunk_bytes % PAGE_BYTES:
            raise ConfigError(f"chunk_bytes={self.chunk_bytes!r} must be a positive multiple of {PAGE_BYTES}")
        if self.direct_io not in ("auto", "on", "off"):
            raise ConfigError(f"direct_io={self.direct_io!r} must be 'auto', 'on' or 'off'")
        if isinstance(self.remote_timeout_s, bool) or not isinstance(self.remote_timeout_s, (int, float)) \
                or not self.remote_timeout_s > 0:
            raise ConfigError(f"remote_timeout_s={self.remote_timeout_s!r} must be a positive number of seconds")
        if self.max_unsynced_bytes is not None and (not whole(self.max_unsynced_bytes) or self.max_unsynced_bytes < 1):
            raise ConfigError(f"max_unsynced_bytes={self.max_unsynced_bytes!r} must be a positive int (bytes) or None")
        check_bool("verify", self.verify)
        if not whole(self.max_pending) or self.max_pending < 1:
            raise ConfigError(
                f"max_pending={self.max_pending!r} must be at least 1 (each pending save holds one staging buffer)"
            )


def check_bool(name: str, value: object) -> bool:
    """``value`` if it is a bool (``verify="no"`` must not mean yes); else a ConfigError naming ``name``."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} must be True or False")
    return value


def check_local_dir(value: object) -> os.PathLike[str] | str:
    """``value`` if it names a local directory; a ConfigError for ``None``, a non-path or a URL."""
    if isinstance(value, bool) or not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise ConfigError(f"local_dir={value!r} must be a directory path (str or pathlib.Path), e.g. '/nvme/ckpt'")
    text = os.fspath(value)
    if isinstance(text, str) and is_url(text):
        raise ConfigError(f"local_dir={text!r} is a URL; local_dir is a directory on this machine (ideally NVMe) and "
                          f"the URL goes in remote_url: local_dir='/nvme/ckpt', remote_url={text!r}")
    return value


def check_remote_url(value: object) -> str | None:
    """``value`` if it is ``None`` or a URL with a scheme and a bucket or path after it; else a ConfigError."""
    if value is None:
        return None
    if not isinstance(value, str) or "://" not in value:
        raise ConfigError(f"remote_url={value!r} is not a URL; pass e.g. 's3://bucket/run-7' or "
                          "'file:///mnt/shared/run', or None for local only")
    scheme, _, rest = value.partition("://")
    if not scheme or not rest.strip("/"):
        raise ConfigError(f"remote_url={value!r} names no bucket or path after {scheme or 'its scheme'}://; pass e.g. "
                          f"'{scheme or 's3'}://bucket/run-7'")
    return value


def check_storage_options(value: object) -> dict | None:
    """``value`` if it is ``None`` or a dict (fsspec's keyword arguments); else a ConfigError."""
    if value is not None and not isinstance(value, dict):  # its type only: the value may hold credentials
        raise ConfigError(f"storage_options (a {type(value).__name__}) must be a dict of fsspec options, e.g. "
                          "{'client_kwargs': {'endpoint_url': 'http://127.0.0.1:9000'}}, or None")
    return value


def remote_lease_s() -> int:
    """How long a writer's lease on ``remote_url`` lasts unrenewed: ``PERSIST_REMOTE_LEASE_S`` (>= 10 s)."""
    return _env_int("PERSIST_REMOTE_LEASE_S", 600, minimum=10)


def run_id_from_env() -> str | None:
    """The run's id from the launcher: ``PERSIST_RUN_ID``, else torchrun's or SLURM's job id, else ``None``."""
    for name in ("PERSIST_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        value = os.environ.get(name, "").strip()
        if value and value != "none":
            return value
    return None


def check_metadata(value: object) -> None:
    """``value`` must be ``None`` or a dict of JSON-able values (it goes into the manifest as JSON)."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise ConfigError(f"metadata={value!r} must be a dict of JSON-able values (or None)")
    try:
        json.dumps(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"metadata={value!r} cannot be written as JSON ({e}); keep str, number, bool, None, list "
                          "and dict values") from e
