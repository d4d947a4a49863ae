"""A memory snapshot's image sent to another rank (issue 42 b): the partner copies' messages, bytes only.

One image goes as ``BEGIN`` (the step, the record's length, the image's length) and the record (the snapshot's
manifest), then ``CHUNK`` s (offset, length, then the bytes), then ``END``; a sender that has something newer to
send says ``ABORT`` instead of the next chunk (newest wins), one without the image says ``NONE``. The receiver
writes the chunks into a file and, at ``END``, checks every byte against the record's checksums: an image that
does not verify is no copy. ``ACK`` (the background copies' answer) and ``STOP`` (the sender is closing) complete
the set. Who sends what when is :mod:`persist_core.sync.partner`'s (background) and
:mod:`persist_core.load.agree`'s (restore) business; this module only moves one image.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Callable
from pathlib import Path

import crc32c

from persist_core.distributed import PointToPoint
from persist_core.errors import ConfigError, CorruptCheckpointError
from persist_core.format.manifest import Manifest
from persist_core.tiers.memory import Snapshot

log = logging.getLogger(__name__)

BEGIN, CHUNK, END, ABORT, STOP, NONE, ACK = range(1, 8)
_HEADER = struct.Struct("<4q")  # op, step, a, b


def send_header(p2p: PointToPoint, peer: int, tag: int, op: int, step: int = 0, a: int = 0, b: int = 0) -> None:
    p2p.send(_HEADER.pack(op, step, a, b), peer, tag)


def recv_header(p2p: PointToPoint, peer: int, tag: int) -> tuple[int, int, int, int]:
    """``(op, step, a, b)`` of the next message from ``peer``."""
    buf = bytearray(_HEADER.size)
    p2p.recv_into(buf, peer, tag)
    op, step, a, b = _HEADER.unpack(buf)
    return op, step, a, b


def send_image(p2p: PointToPoint, peer: int, tag: int, snap: Snapshot, *, chunk_bytes: int,
               newer: Callable[[], bool] = lambda: False) -> bool:
    """Send ``snap`` (its record, then its image in chunks of ``chunk_bytes``) to ``peer``; ``False`` when ``newer()``
    said to give it up (``ABORT`` sent) or its slot could not be read (``ABORT`` too: the receiver never waits)."""
    record = snap.manifest.to_bytes()
    nbytes = snap.manifest.files[0].size
    send_header(p2p, peer, tag, BEGIN, snap.step, len(record), nbytes)
    p2p.send(record, peer, tag)
    try:
        fd = os.open(snap.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        log.warning("[step=%d] the memory snapshot %s cannot be read for its partner copy: %s", snap.step, snap.path, e)
        send_header(p2p, peer, tag, ABORT, snap.step)
        return False
    try:
        buf = bytearray(min(chunk_bytes, nbytes))
        for offset in range(0, nbytes, chunk_bytes):
            n = min(chunk_bytes, nbytes - offset)
            view = memoryview(buf)[:n]
            if newer() or os.preadv(fd, [view], offset) != n:
                send_header(p2p, peer, tag, ABORT, snap.step)
                return False
            send_header(p2p, peer, tag, CHUNK, snap.step, offset, n)
            p2p.send(view, peer, tag)
    finally:
        os.close(fd)
    send_header(p2p, peer, tag, END, snap.step)
    return True


def recv_image(p2p: PointToPoint, peer: int, tag: int, begin: tuple[int, int, int, int], path: Path | None,
               *, chunk_bytes: int) -> tuple[bool, Manifest | None]:
    """After the ``BEGIN`` header ``begin``: the record and the chunks that follow from ``peer``, written into the
    file ``path`` (made 0600, never through a link; ``None``: received and dropped, e.g. no room). ``(ended, the
    record)``: ``ended`` once ``END`` came (``False``: the sender gave the image up, ``ABORT``); the record when
    every byte verified, ``None`` for a write that failed or bytes that do not verify (said in the log). Every
    message of the image is received whatever happens, so the stream stays in step.
    """
    _, step, record_len, nbytes = begin
    record = bytearray(record_len)
    p2p.recv_into(record, peer, tag)
    fd = None
    if path is not None:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            os.ftruncate(fd, max(nbytes, os.fstat(fd).st_size))
        except OSError as e:
            log.warning("[step=%d] no room for the partner copy at %s (%s): received and dropped", step, path, e)
            if fd is not None:
                os.close(fd)
            fd = None
    buf = bytearray(min(chunk_bytes, max(nbytes, 1)))
    try:
        while True:
            op, _, offset, n = recv_header(p2p, peer, tag)
            if op == CHUNK:
                if n > len(buf):
                    buf = bytearray(n)
                view = memoryview(buf)[:n]
                p2p.recv_into(view, peer, tag)
                if fd is not None:
                    try:
                        os.pwrite(fd, view, offset)
                    except OSError as e:
                        log.warning("[step=%d] the partner copy at %s failed writing (%s): dropped", step, path, e)
                        os.close(fd)
                        fd = None
                continue
            if op != END or fd is None:
                return op == END, None
            return True, _verified(fd, bytes(record), path, step)
    finally:
        if fd is not None:
            os.close(fd)


def _verified(fd: int, record: bytes, path: Path | None, step: int) -> Manifest | None:
    """The manifest ``record`` when the image in ``fd`` matches its checksums, every block; else ``None``."""
    try:
        manifest = Manifest.from_bytes(record, where=str(path))
        (fe,) = manifest.files
        view = memoryview(bytearray(fe.chunk_bytes or fe.size or 1))
        for i, expected in enumerate(fe.chunks or ()):
            offset = i * fe.chunk_bytes
            n = min(fe.chunk_bytes, fe.size - offset)
            if os.preadv(fd, [view[:n]], offset) != n or crc32c.crc32c(view[:n]) != expected:
                raise CorruptCheckpointError(f"block {i} of {path} does not match its checksum")
        if not fe.chunks:
            raise CorruptCheckpointError(f"the record of {path} has no checksums")
        return manifest
    except (CorruptCheckpointError, ConfigError, ValueError, OSError) as e:
        log.warning("[step=%d] the partner copy does not verify (%s): not kept", step, e)
        return None
