"""A shard file as stored blocks: encoding one for upload (blocks on threads, written in order into a temporary
file the transfer sends) and decoding a ranged read of some of its blocks.

zstd and AES-GCM release the GIL while they work, so the blocks of a file are encoded on up to :func:`threads`
threads at once; at most twice that many blocks are held in memory.
"""

from __future__ import annotations

import hashlib
import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
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


def encode_file(codec: Codec, src: Path, dst: Path, f: FileEntry, *, run: str, save: str,
                pool: ThreadPoolExecutor) -> tuple[int, ...]:
    """Write the stored blocks of shard file ``src`` (``f``) into ``dst``; their lengths."""
    with open(src, "rb") as fh:
        widths = planes.block_widths(fh.read(_HEAD_BYTES), file_size=f.size, block_bytes=f.chunk_bytes)
    lengths: list[int] = []
    window: deque[Future[bytes]] = deque()
    fd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    try:
        with open(dst, "wb") as out:
            def drain(keep: int) -> None:
                while len(window) > keep:
                    stored = window.popleft().result()
                    out.write(stored)
                    lengths.append(len(stored))

            for i in range(len(f.chunks)):
                data = os.pread(fd, min(f.chunk_bytes, f.size - i * f.chunk_bytes), i * f.chunk_bytes)
                window.append(pool.submit(codec.encode, data, widths[min(i, len(widths) - 1)],
                                          block_aad(run, save, f.name, i)))
                drain(2 * pool._max_workers)  # noqa: SLF001  # bounded memory: the pool's own size
            drain(0)
    finally:
        os.close(fd)
    return tuple(lengths)


def stored_range(lengths: tuple[int, ...], first: int, stop: int) -> tuple[int, int]:
    """Bytes ``[start, end)`` of the stored object that hold blocks ``[first, stop)``."""
    start = sum(lengths[:first])
    return start, start + sum(lengths[first:stop])


def decode_blocks(codec: Codec, data: bytes | memoryview, lengths: tuple[int, ...], f: FileEntry, first: int,
                  stop: int, *, run: str, save: str, encrypted: bool, where: str,
                  pool: ThreadPoolExecutor | None = None) -> bytes:
    """The logical bytes of blocks ``[first, stop)`` of ``f`` from ``data``, their stored bytes (one ranged read)."""
    view = memoryview(data)
    jobs: list[Callable[[], bytes]] = []
    pos = 0
    for i in range(first, stop):
        n = lengths[i]
        piece = view[pos : pos + n]
        pos += n
        size = min(f.chunk_bytes, f.size - i * f.chunk_bytes)
        jobs.append(lambda piece=piece, i=i, size=size: codec.decode(
            piece, block_aad(run, save, f.name, i), encrypted=encrypted, size=size, where=f"{where} block {i}"))
    if pool is None or len(jobs) == 1:
        return b"".join(job() for job in jobs)
    return b"".join(fut.result() for fut in [pool.submit(job) for job in jobs])
