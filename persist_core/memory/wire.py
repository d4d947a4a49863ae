"""A memory snapshot's image sent to another rank (issue 42 b): the partner copies' messages, bytes only.

One image goes as ``BEGIN`` (the step, the record's length, the image's length) and the record (the snapshot's
manifest), then ``CHUNK`` s (offset, length, then the bytes), then ``END``; a sender that is closing, or cannot read
its slot, says ``ABORT`` instead of the next chunk (alone, without ``BEGIN``: it has no snapshot of that copy step), one
without the image says ``NONE``. The receiver
writes the chunks into a file and, at ``END``, checks every byte against the record's checksums: an image that
does not verify is no copy. ``ACK`` (the background copies' answer) and ``STOP`` (the sender is closing) complete
the set. Who sends what when is :mod:`persist_core.memory.partner`'s (background) and
:mod:`persist_core.load.agree`'s (restore) business; this module only moves one image.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
from collections.abc import Callable
from pathlib import Path

import crc32c

from persist_core.distributed import PointToPoint
from persist_core.errors import ConfigError, CorruptCheckpointError
from persist_core.format.manifest import Manifest
from persist_core.memory.store import Snapshot

log = logging.getLogger(__name__)

BEGIN, CHUNK, END, ABORT, STOP, NONE, ACK = range(1, 8)
_HEADER = struct.Struct("<4q")  # op, step, a, b
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_NO_ROOM: set[Path] = set()  # directories whose lack of room was said  # the pages mapped at once, not faulted in one by one


def send_header(p2p: PointToPoint, peer: int, tag: int, op: int, step: int = 0, a: int = 0, b: int = 0) -> None:
    p2p.send(_HEADER.pack(op, step, a, b), peer, tag)


def recv_header(p2p: PointToPoint, peer: int, tag: int) -> tuple[int, int, int, int]:
    """``(op, step, a, b)`` of the next message from ``peer``."""
    buf = bytearray(_HEADER.size)
    p2p.recv_into(buf, peer, tag)
    op, step, a, b = _HEADER.unpack(buf)
    return op, step, a, b


def send_image(p2p: PointToPoint, peer: int, tag: int, snap: Snapshot, *, chunk_bytes: int,
               give_up: Callable[[], bool] = lambda: False) -> bool:
    """Send ``snap`` (its record, then its image in chunks of ``chunk_bytes``) to ``peer``; ``False`` when
    ``give_up()`` said so before a chunk (``ABORT`` sent) or its slot could not be read (``ABORT`` too: the receiver
    never waits)."""
    record = snap.manifest.to_bytes()
    nbytes = snap.manifest.files[0].size
    send_header(p2p, peer, tag, BEGIN, snap.step, len(record), nbytes)
    p2p.send(record, peer, tag)
    try:  # sent straight from the slot's pages (a private mapping: writable for the channel, never written)
        with open(snap.path, "rb", opener=lambda p, f: os.open(p, f | os.O_NOFOLLOW | os.O_CLOEXEC)) as f:
            image = mmap.mmap(f.fileno(), nbytes, flags=mmap.MAP_PRIVATE | _POPULATE) if nbytes else None
    except (OSError, ValueError) as e:
        log.warning("[step=%d] the memory snapshot %s cannot be read for its partner copy: %s", snap.step, snap.path, e)
        send_header(p2p, peer, tag, ABORT, snap.step)
        return False
    try:
        for offset in range(0, nbytes, chunk_bytes):
            if give_up():
                send_header(p2p, peer, tag, ABORT, snap.step)
                return False
            n = min(chunk_bytes, nbytes - offset)
            send_header(p2p, peer, tag, CHUNK, snap.step, offset, n)
            p2p.send(memoryview(image)[offset : offset + n], peer, tag)
    finally:
        if image is not None:
            image.close()
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
    image = _mapped(path, nbytes, step)  # received straight into the slot's pages (None: dropped)
    spare = bytearray(min(chunk_bytes, max(nbytes, 1)))
    try:
        while True:
            op, _, offset, n = recv_header(p2p, peer, tag)
            if op == CHUNK:
                if image is not None and 0 <= offset and offset + n <= nbytes:
                    p2p.recv_into(memoryview(image)[offset : offset + n], peer, tag)
                else:
                    spare = spare if n <= len(spare) else bytearray(n)
                    p2p.recv_into(memoryview(spare)[:n], peer, tag)
                continue
            if op != END or image is None:
                return op == END, None
            return True, _verified(image, bytes(record), path, step)
    finally:
        if image is not None:
            image.close()


def _mapped(path: Path | None, nbytes: int, step: int) -> mmap.mmap | None:
    """``path`` (0600, never through a link) with room for ``nbytes`` reserved up front (so writing its pages never
    raises a SIGBUS on a full tmpfs), mapped shared; ``None`` where there is no room (said in the log)."""
    if path is None or nbytes <= 0:
        return None
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        log.warning("[step=%d] the partner copy cannot be made at %s (%s): received and dropped", step, path, e)
        return None
    try:
        if os.fstat(fd).st_size < nbytes:
            os.posix_fallocate(fd, 0, nbytes)
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _POPULATE)
    except OSError as e:  # said once per directory (every copy would say it again)
        said = path.parent in _NO_ROOM
        _NO_ROOM.add(path.parent)
        (log.debug if said else log.warning)("[step=%d] no room for the partner copy at %s (%s): received and "
                                             "dropped", step, path, e)
        return None
    finally:
        os.close(fd)


def _verified(image: mmap.mmap, record: bytes, path: Path | None, step: int) -> Manifest | None:
    """The manifest ``record`` when ``image`` matches its checksums, every block; else ``None``."""
    try:
        manifest = Manifest.from_bytes(record, where=str(path))
        (fe,) = manifest.files
        if not fe.chunks or fe.size > len(image):
            raise CorruptCheckpointError(f"the record of {path} has no checksums, or more bytes than came")
        view = memoryview(image)
        try:
            for i, expected in enumerate(fe.chunks):
                if crc32c.crc32c(view[i * fe.chunk_bytes : min((i + 1) * fe.chunk_bytes, fe.size)]) != expected:
                    raise CorruptCheckpointError(f"block {i} of {path} does not match its checksum")
        finally:
            view.release()
        return manifest
    except (CorruptCheckpointError, ConfigError, ValueError) as e:
        log.warning("[step=%d] the partner copy does not verify (%s): not kept", step, e)
        return None
