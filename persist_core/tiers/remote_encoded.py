"""The remote tier's transfers of encoded files (issue 56, :mod:`persist_core.tiers.codec`), at the link's rate.

Upload (:func:`put`): the blocks are encoded on the codec's threads and sent as they are made, so an upload takes
about as long as the longer of encoding and sending, not both: on S3 as the parts of a multipart upload
(:meth:`~persist_core.tiers._s3.S3Transfer.put_stream`: each request retried on its own, a part with the same bytes),
elsewhere written one after another through fsspec (the whole file retried, encoded again: the same lengths, fresh
nonces). Restore (:func:`read_into`): each ranged read decoded on the codec's threads straight into the memory that
holds its blocks; block 0, which a restore decodes first to read the file's header (:class:`Heads`), is not read
twice.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from persist_core.format.manifest import FileEntry
from persist_core.layout import checkpoint_dirname


def put(tier: Any, s3: Any, local_ckpt: Path, step: int, f: FileEntry, target: str) -> int:
    """Upload shard file ``f`` of ``local_ckpt`` encoded to ``target`` (see the module); the bytes uploaded.
    ``tier``: the :class:`~persist_core.tiers.remote.RemoteTier`; ``s3``: its threaded S3 client, or ``None``."""
    if s3 is not None:
        return s3.put_stream(tier.stored.blocks(local_ckpt, step, f), target, size_hint=f.size + 64 * len(f.chunks),
                             retry=tier.retry, turn=tier.turn.wait)
    return tier.retry(f"uploading {target}", lambda: _write(tier, tier.stored.blocks(local_ckpt, step, f), target))


def _write(tier: Any, pieces: Any, target: str) -> int:
    """Write ``pieces`` one after another into ``target`` through fsspec (multipart on s3fs): the bytes written."""
    n = 0
    try:
        with tier.fs.open(target, "wb") as out:
            for piece in pieces:
                tier.turn.wait()
                out.write(piece)
                n += len(piece)
    finally:
        pieces.close()
    return n


class Heads:
    """Block 0 of a file as a header read decoded it, kept (``keep``) for the restore's read of block 0 (``take``):
    at most ``most`` files' at a time, the oldest dropped."""

    def __init__(self, most: int) -> None:
        self._most = max(1, most)
        self._held: dict[tuple[int, str], tuple[int, Any]] = {}
        self._lock = threading.Lock()

    def keep(self, step: int, name: str, stop: int, data: Any) -> None:
        """Blocks ``[0, stop)`` of file ``name`` of ``step``, decoded (``data``)."""
        with self._lock:
            self._held[(step, name)] = (stop, data)
            while len(self._held) > self._most:
                self._held.pop(next(iter(self._held)))

    def take(self, step: int, name: str) -> tuple[int, Any] | None:
        with self._lock:
            return self._held.pop((step, name), None)


def read_into(tier: Any, step: int, f: FileEntry, first: int, views: list[memoryview], heads: Heads, *,
              where: str) -> int:
    """Fill ``views`` (whole checksum blocks of ``f`` from block ``first`` on, in order) with their decoded bytes,
    by one ranged read of their stored bytes (not verified); the bytes put into them (their length; what the blocks
    hold when they do not end where the views do: then nothing is put)."""
    views = [v.cast("B") if v.format != "B" or v.ndim != 1 else v for v in views]
    start = first * f.chunk_bytes
    stop = -(-(start + sum(len(v) for v in views)) // f.chunk_bytes)
    if min(stop * f.chunk_bytes, f.size) - start != sum(len(v) for v in views):  # not whole blocks
        return len(tier.read_logical(step, f, first, stop))
    head = heads.take(step, f.name) if first == 0 else None
    if head is not None and head[0] <= stop:  # block 0 was read already, for the header
        views = _fill(views, memoryview(head[1]))
        first = head[0]
    if first < stop:
        source = f"{tier.path_of(checkpoint_dirname(step))}/{f.name}"
        tier.stored.read(step, f, first, stop, lambda start, end: tier.retry(
            f"reading {source}", lambda: tier.read_stored(source, start, end)), where=where, into=views)
    return min(stop * f.chunk_bytes, f.size) - start


def _fill(views: list[memoryview], data: memoryview) -> list[memoryview]:
    """Copy ``data`` into the first bytes of ``views`` (laid end to end); the views of what is left."""
    pos, rest = 0, []
    for view in views:
        n = max(0, min(len(view), len(data) - pos))
        view[:n] = data[pos : pos + n]
        pos += n
        if n < len(view):
            rest.append(view[n:])
    return rest
