"""What the remote tier adds to fsspec: a progress callback that gives a guarded update its turn, bounded network
waits for S3, and a ranged read into given memory."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import fsspec

from persist_core import _link_knobs


class Yielding(fsspec.callbacks.Callback):
    """An fsspec progress callback that waits for ``turn`` at each piece a transfer reports."""

    def __init__(self, turn: Callable[[], None]) -> None:
        super().__init__()
        self._turn = turn

    def call(self, *args: Any, **kwargs: Any) -> None:
        self._turn()


def with_timeouts(url: str, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """``storage_options`` with bounded network waits for S3 (``PERSIST_REMOTE_IO_TIMEOUT_S``), unless given:
    botocore's own 60 s per read, retried by botocore and s3fs, let one half-open connection hold an upload
    for many minutes. (Their retry counts stay: they absorb stale pooled connections after an outage.)"""
    options = dict(storage_options or {})
    if url.split("://", 1)[0] not in ("s3", "s3a"):
        return options
    timeout = _link_knobs.remote_io_timeout_s()
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("read_timeout", timeout)
    config.setdefault("connect_timeout", max(1, timeout // 2))
    options["config_kwargs"] = config
    return options


def read_into(fs: Any, path: str, start: int, views: Sequence[memoryview]) -> int:
    """Fill ``views`` (byte views, in order) from ``path`` at ``start`` by one ranged read of ``fs``; the bytes read
    (fewer when the object is shorter). fsspec returns the range as bytes: one copy more than S3's
    :meth:`~persist_core.tiers._s3.S3Transfer.read_into`."""
    data = memoryview(fs.cat_file(path, start=start, end=start + sum(len(v) for v in views)))
    pos = 0
    for view in views:
        n = max(0, min(len(view), len(data) - pos))
        view[:n] = data[pos : pos + n]
        pos += n
    return len(data)
