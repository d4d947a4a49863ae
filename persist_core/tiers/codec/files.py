"""A shard file as stored blocks: encoding one for upload (blocks on threads, handed in order to the transfer as
they are done, so encoding and sending overlap) and decoding a ranged read of some of its blocks into the memory
that holds them.

zstd, AES-GCM and numpy's byte-plane loops release the GIL while they work, so the blocks of a file are encoded on up
to :func:`threads` threads at once; at most twice that many encoded blocks wait for the transfer.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

from persist_core.format.manifest import FileEntry, Manifest
from persist_core.tiers.codec import planes
from persist_core.tiers.codec.blocks import Codec, block_aad

#: bytes of a shard file read to find its tensors' dtypes (the safetensors header is at most this long in practice)
_HEAD_BYTES = 1 << 20


def threads() -> int:
    """How many blocks are encoded or decoded at once."""
    return max(1, min(8, os.cpu_count() or 1))


def save_id(manifest: Manifest) -> str:
    """The id of one committed checkpoint, the same on every node that uploads a part of it: a digest of its step,
    time and file checksums (a checkpoint saved again at the same step is another save)."""
    what = repr((manifest.step, manifest.time, sorted((f.name, f.checksum, f.size) for f in manifest.files)))
    return hashlib.sha256(what.encode()).hexdigest()[:24]


def run_of(manifest: Manifest) -> str:
    return str((manifest.lineage or {}).get("run") or "")


def encode_blocks(codec: Codec, src: Path, f: FileEntry, *, run: str, save: str,
                  pool: ThreadPoolExecutor) -> Iterator[bytes | bytearray]:
    """The stored blocks of shard file ``src`` (``f``), in order, as they are encoded: each block read and encoded on
    ``pool`` (up to twice the pool's size ahead of the one the caller takes: bounded memory), so that the transfer
    sends block ``i`` while blocks ``i+1...`` are encoded."""
    with open(src, "rb") as fh:
        widths = planes.block_widths(fh.read(_HEAD_BYTES), file_size=f.size, block_bytes=f.chunk_bytes)
    fd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)

    def encode(i: int) -> bytes | bytearray:
        data = os.pread(fd, min(f.chunk_bytes, f.size - i * f.chunk_bytes), i * f.chunk_bytes)
        return codec.encode(data, widths[min(i, len(widths) - 1)], block_aad(run, save, f.name, i))

    window: deque[Future[bytes | bytearray]] = deque()
    ahead = 2 * pool._max_workers  # noqa: SLF001  # the pool's own size
    try:
        for i in range(len(f.chunks)):
            window.append(pool.submit(encode, i))
            while len(window) > ahead:
                yield window.popleft().result()
        while window:
            yield window.popleft().result()
    finally:  # taken or not (a failed transfer closes the generator): no encoding reads the file once it is closed
        for fut in window:
            fut.cancel()
        wait(window)
        os.close(fd)


def stored_range(lengths: tuple[int, ...], first: int, stop: int) -> tuple[int, int]:
    """Bytes ``[start, end)`` of the stored object that hold blocks ``[first, stop)``."""
    start = sum(lengths[:first])
    return start, start + sum(lengths[first:stop])


def decode_blocks(codec: Codec, data: bytes | memoryview, lengths: tuple[int, ...], f: FileEntry, first: int,
                  stop: int, *, run: str, save: str, encrypted: bool, where: str,
                  pool: ThreadPoolExecutor | None = None) -> bytes | bytearray:
    """The logical bytes of blocks ``[first, stop)`` of ``f`` from ``data``, their stored bytes (one ranged read)."""
    out = bytearray(min(stop * f.chunk_bytes, f.size) - first * f.chunk_bytes)
    decode_into(codec, data, lengths, f, first, stop, [memoryview(out)], run=run, save=save, encrypted=encrypted,
                where=where, pool=pool)
    return out


def decode_into(codec: Codec, data: bytes | memoryview, lengths: tuple[int, ...], f: FileEntry, first: int,
                stop: int, views: list[memoryview], *, run: str, save: str, encrypted: bool, where: str,
                pool: ThreadPoolExecutor | None = None) -> None:
    """Decode blocks ``[first, stop)`` of ``f`` from ``data`` (their stored bytes: one ranged read) into ``views``
    (byte views that hold the blocks' logical bytes, in order), each block on ``pool``: straight into the view that
    holds it whole, else into a block of its own that is then copied into the views it spans."""
    stored = memoryview(data)
    targets = _Targets([v.cast("B") if v.format != "B" or v.ndim != 1 else v for v in views])
    jobs: list[Callable[[], None]] = []
    pos = 0
    for i in range(first, stop):
        piece = stored[pos : pos + lengths[i]]
        pos += lengths[i]
        at = (i - first) * f.chunk_bytes
        size = min(f.chunk_bytes, f.size - i * f.chunk_bytes)

        def job(piece: memoryview = piece, i: int = i, at: int = at, size: int = size) -> None:
            whole = targets.whole(at, size)
            out = whole if whole is not None else memoryview(bytearray(size))
            codec.decode_into(piece, block_aad(run, save, f.name, i), encrypted=encrypted, out=out,
                              where=f"{where} block {i}")
            if whole is None:
                targets.scatter(at, out)

        jobs.append(job)
    if pool is None or len(jobs) == 1:
        for job in jobs:
            job()
        return
    futures = [pool.submit(job) for job in jobs]
    wait(futures)
    for fut in futures:
        fut.result()


class _Targets:
    """Byte views laid end to end: the one that holds a range whole, or a range copied across them."""

    def __init__(self, views: list[memoryview]) -> None:
        self._views = views
        self._starts = list(itertools.accumulate((len(v) for v in views), initial=0))

    def whole(self, at: int, size: int) -> memoryview | None:
        k = bisect.bisect_right(self._starts, at) - 1
        if 0 <= k < len(self._views) and at + size <= self._starts[k + 1]:
            return self._views[k][at - self._starts[k] : at - self._starts[k] + size]
        return None

    def scatter(self, at: int, data: memoryview) -> None:
        k, pos = bisect.bisect_right(self._starts, at) - 1, 0
        while pos < len(data) and k < len(self._views):
            lo = at + pos - self._starts[k]
            n = min(len(self._views[k]) - lo, len(data) - pos)
            self._views[k][lo : lo + n] = data[pos : pos + n]
            pos, k = pos + n, k + 1
