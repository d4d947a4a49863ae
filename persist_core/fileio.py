"""Parallel shard writes and the local commit protocol.

Who calls what, in order (the engine's writer thread, for one checkpoint):

1. ``os.mkdir(tmp)`` (a name from :mod:`persist_core.layout`);
2. :func:`write_file` for each shard: ``pwrite`` of chunks straight from the staging buffer by a
   pool of threads (``O_DIRECT`` where the file system takes it), a crc32c per chunk computed by
   the same thread, then ``fsync``;
3. :func:`commit_dir`: the manifest written and fsynced last, the directory fsynced, renamed into
   place, and the parent fsynced. A directory without a manifest is never a checkpoint.

All file system calls go through a :class:`FileOps`, so a test can inject a failure (ENOSPC on
the Nth write) at exactly the place the real one would happen.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import math
import os
import secrets
from collections.abc import Callable
from concurrent.futures import Executor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import crc32c

from persist_core._knobs import PAGE_BYTES
from persist_core.layout import MANIFEST_NAME

log = logging.getLogger(__name__)

CHECKSUM_ALGORITHM = "crc32c"


class FileOps(Protocol):
    """The file system calls the writer makes (``os`` by default)."""

    def open(self, path: str, flags: int, mode: int = 0o644) -> int: ...
    def pwrite(self, fd: int, data: memoryview, offset: int) -> int: ...
    def fsync(self, fd: int) -> None: ...
    def close(self, fd: int) -> None: ...


class OsFileOps:
    """:class:`FileOps` straight to ``os``."""

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        return os.open(path, flags, mode)

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        return os.pwrite(fd, data, offset)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def close(self, fd: int) -> None:
        os.close(fd)


@dataclass(frozen=True)
class WrittenFile:
    """What :func:`write_file` wrote: size, a crc32c per ``chunk_bytes`` block (:func:`checksum_block`, not the
    size of a write), and whether ``O_DIRECT`` was used."""

    name: str
    size: int
    chunk_bytes: int
    chunks: tuple[int, ...]
    direct_io: bool


OnChunk = Callable[[int, int], None]


CHECKSUM_BLOCK_BYTES = 256 << 10  # the checksum granularity: a resharding read verifies whole blocks, so keep them small


def checksum_block(chunk_bytes: int) -> int:
    """Bytes per checksum for writes of ``chunk_bytes``: 256 KiB, or less where it must divide ``chunk_bytes``."""
    return math.gcd(chunk_bytes, CHECKSUM_BLOCK_BYTES)


def _write_chunk(ops: FileOps, fd: int, data: memoryview, offset: int, on_chunk: OnChunk | None,
                 block: int, turn: Callable[[], None], piece: int) -> tuple[int, ...]:
    crc = []
    for o in range(0, len(data), block):
        turn()  # waits while a guarded update has the cores
        crc.append(crc32c.crc32c(data[o : o + block]))
    done = 0
    while done < len(data):
        turn()  # a hold stops the chunk's next piece: what is in flight is at most one piece a thread
        n = ops.pwrite(fd, data[done : done + piece], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"pwrite returned {n} at offset {offset + done}")
        done += n
    if on_chunk is not None:
        on_chunk(offset, len(data))
    return tuple(crc)


def _write_all(path: str, data: memoryview, flags: int, *, pool: Executor, chunk_bytes: int, ops: FileOps,
               on_chunk: OnChunk | None, turn: Callable[[], None], piece_bytes: int | None) -> tuple[int, ...]:
    fd = ops.open(path, flags, 0o644)
    try:
        block, piece = checksum_block(chunk_bytes), min(piece_bytes or chunk_bytes, chunk_bytes)
        futures = [pool.submit(_write_chunk, ops, fd, data[o : o + chunk_bytes], o, on_chunk, block, turn, piece)
                   for o in range(0, len(data), chunk_bytes)]
        wait(futures)  # every chunk finishes before the fd closes, failed or not
        crcs = tuple(c for f in futures for c in f.result())
        ops.fsync(fd)
        return crcs
    finally:
        ops.close(fd)


#: The pwrite size of writes that yield to guarded updates (:class:`persist_core.save.overlap.Turn`): a hold
#: stops the next piece, and the ones in flight (the disk's DMA) end within milliseconds. One 32 MiB
#: ``O_DIRECT`` pwrite per chunk ran on through the update and slowed it by 10–19% on this host (4 MiB
#: pieces: 2–8%, at 0.88–0.92x the write speed); ``benchmarks/bench_pieces.py`` measures it by size,
#: ``benchmarks/bench_overlap.py`` what it changes in C.
YIELD_PIECE_BYTES = 4 << 20


def no_wait() -> None:
    """The ``turn`` of writes that never yield (no guarded update to wait for)."""


def write_file(path: Path, data: memoryview, *, pool: Executor, chunk_bytes: int, direct_io: str, ops: FileOps,
               on_chunk: OnChunk | None = None, turn: Callable[[], None] = no_wait,
               piece_bytes: int | None = None) -> WrittenFile:
    """Write ``data`` to a new file at ``path`` in parallel chunks and fsync it.

    Args:
        path: the file to create (it must not exist).
        data: the whole file image; page-aligned with a 4 KiB-multiple length for ``O_DIRECT``.
        pool: threads that write chunks.
        chunk_bytes: bytes per ``pwrite`` (a multiple of 4 KiB); each has a crc32c per :func:`checksum_block`.
        direct_io: ``"auto"`` tries ``O_DIRECT`` and falls back to buffered writes when the file
            system refuses it; ``"on"`` insists; ``"off"`` never tries.
        ops: the file system calls.
        on_chunk: called as ``on_chunk(offset, length)`` once a chunk is written and checksummed,
            after which the caller may reuse those bytes of ``data``. Only with ``direct_io``
            ``"on"`` or ``"off"``: the ``"auto"`` fallback rewrites the file from ``data``.
        turn: called before each checksum block and each pwrite; it blocks while the training's update has
            the host (:class:`persist_core.save.overlap.Turn`).
        piece_bytes: write each chunk in pwrites of this many bytes (a multiple of 4 KiB), ``turn`` before
            each; ``None``: one pwrite a chunk. Writes that yield to guarded updates pass
            :data:`YIELD_PIECE_BYTES`.

    Raises:
        OSError: the write or fsync failed (the caller removes the partial file's directory).
    """
    if on_chunk is not None and direct_io == "auto":
        raise ValueError("on_chunk needs a settled direct_io ('on' or 'off'): the 'auto' fallback re-reads data")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    aligned = ctypes_address(data) % PAGE_BYTES == 0 and len(data) % PAGE_BYTES == 0
    if direct_io != "off" and hasattr(os, "O_DIRECT") and aligned:
        try:
            crcs = _write_all(str(path), data, flags | os.O_DIRECT, pool=pool, chunk_bytes=chunk_bytes, ops=ops,
                              on_chunk=on_chunk, turn=turn, piece_bytes=piece_bytes)
            return WrittenFile(path.name, len(data), checksum_block(chunk_bytes), crcs, True)
        except OSError as e:
            if direct_io == "on" or e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            log.info("O_DIRECT refused for %s (%s); writing buffered", path, e)
            path.unlink(missing_ok=True)
    elif direct_io == "on":
        raise OSError(errno.EINVAL, f"O_DIRECT needs a page-aligned buffer and os.O_DIRECT; cannot write {path}")
    crcs = _write_all(str(path), data, flags, pool=pool, chunk_bytes=chunk_bytes, ops=ops, on_chunk=on_chunk,
                      turn=turn, piece_bytes=piece_bytes)
    return WrittenFile(path.name, len(data), checksum_block(chunk_bytes), crcs, False)


def ctypes_address(view: memoryview) -> int:
    """Address of the first byte of a writable ``memoryview``."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def fsync_dir(path: Path) -> None:
    """fsync a directory, so a rename or new entry in it is durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit_dir(tmp: Path, final: Path, manifest: bytes, *, ops: FileOps, replace: bool = False) -> None:
    """Write the manifest last into ``tmp``, then rename ``tmp`` to ``final`` durably.

    ``replace``: ``final`` may be a committed checkpoint; the two are exchanged in one atomic
    ``renameat2(RENAME_EXCHANGE)``, so ``final`` always names a committed one, and the old one is
    left at ``tmp`` for the caller to remove (see :func:`exchange_dirs` for file systems without it).

    Raises:
        OSError: any step failed; ``final`` then names what it named before (nothing, or the old copy).
    """
    fd = ops.open(str(tmp / MANIFEST_NAME), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(manifest)
        done = 0
        while done < len(view):
            done += ops.pwrite(fd, view[done:], done)
        ops.fsync(fd)
    finally:
        ops.close(fd)
    fsync_dir(tmp)
    exchanged = replace and os.path.lexists(final)
    if exchanged:
        exchange_dirs(tmp, final)
    else:
        os.rename(tmp, final)
    try:
        fsync_dir(final.parent)
    except OSError:  # not durable, so not committed: the names go back (the old copy, if any, to its own)
        if exchanged:
            exchange_dirs(tmp, final)
        else:
            os.rename(final, tmp)
        raise


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange_dirs(new: Path, old: Path) -> None:
    """Put ``new`` at ``old``'s name and ``old``'s directory at ``new``'s, atomically where the kernel can.

    ``renameat2(RENAME_EXCHANGE)`` (Linux 3.15+, ext4/xfs/btrfs/tmpfs) swaps the two names in one
    step. Elsewhere two renames: ``old`` to ``new``'s name with a suffix, then ``new`` into place,
    then the suffixed one to ``new``'s name — a moment in between without ``old``'s name.
    """
    libc = _libc()
    renameat2 = getattr(libc, "renameat2", None) if libc is not None else None
    if renameat2 is not None:
        if renameat2(_AT_FDCWD, os.fsencode(new), _AT_FDCWD, os.fsencode(old), _RENAME_EXCHANGE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(err, f"exchanging {new} and {old}: {os.strerror(err)}")
    aside = new.with_name(new.name + "0")
    os.rename(old, aside)
    os.rename(new, old)
    os.rename(aside, new)


@functools.lru_cache(maxsize=1)
def _libc() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def link_atomically(target: str, dest: Path) -> None:
    """Point the path ``target`` at ``dest`` (a checkpoint directory or a file in it) with one atomic
    rename of a fresh relative symbolic link, durably; ``target``'s directory is created if missing."""
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(target)}.link-{secrets.token_hex(3)}")
    os.symlink(os.path.relpath(dest, parent), tmp)
    try:
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise
    fsync_dir(Path(parent))
