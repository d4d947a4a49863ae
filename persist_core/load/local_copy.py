"""The local copy a streamed restore leaves behind: the verified blocks it read from the remote, written
alongside into a temporary directory of ``local_dir`` and committed there once every block arrived.

Who calls what: :class:`~persist_core.load.remote.RemoteRestore` (for the reader) opens a :class:`LocalCopy` before it
streams a remote checkpoint into tensors, calls :meth:`LocalCopy.write` from its read threads with each
run of verified blocks (before the bytes can change), then :meth:`LocalCopy.finish` on a thread of its
own: if every block of every file arrived, the files are fsynced, the manifest written last and the
directory renamed into place, exactly as a writer commits; otherwise (a load that needed only part of
the files) the temporary directory is removed. Owned by a mark while it exists (see
:mod:`persist_core.ownership`), so a kill leaves only a dead temporary.

The copy is a convenience for the next restore, never a condition of this one: on a disk the file system
says is too small it is not started, and a write that fails (``ENOSPC``) drops it with one warning naming
the path; the load goes on from memory and :meth:`LocalCopy.finish` removes what was written.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from pathlib import Path

from persist_core.fileio import fsync_dir
from persist_core.format.manifest import FileEntry, Manifest
from persist_core.layout import MANIFEST_NAME, checkpoint_dirname
from persist_core.ownership import claim_tmp

log = logging.getLogger(__name__)


class LocalCopy:
    """A checkpoint being copied into ``root`` from the bytes a load reads.

    Args:
        root: ``local_dir``.
        manifest: the checkpoint's manifest (the copy holding every file).
    """

    def __init__(self, root: Path, manifest: Manifest) -> None:
        self._root = root
        self._manifest = manifest
        self._owned = contextlib.ExitStack()
        self._tmp = root
        self._lock = threading.Lock()
        self._seen: dict[str, set[int]] = {f.name: set() for f in manifest.files}
        self._fds: dict[str, int] = {}
        self.failed = False  # a write failed (a full disk): the copy is dropped, the load goes on
        short = _short_of_space(root, manifest.nbytes)
        if short:
            self._drop(short)
            return
        path = root
        try:
            self._tmp = path = self._owned.enter_context(claim_tmp(root, manifest.step))
            for f in manifest.files:
                path = self._tmp / f.name
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                self._fds[f.name] = fd
                os.ftruncate(fd, f.size)
        except OSError as e:
            self._drop(f"could not start it in {e.filename or path}: {e.strerror or e}")

    def write(self, f: FileEntry, first: int, views: list[memoryview]) -> None:
        """Write verified blocks ``first, first + 1, ...`` of file ``f`` (any read thread)."""
        if self.failed:
            return
        offset = first * f.chunk_bytes
        try:
            for view in views:
                view = view.cast("B") if view.format != "B" else view
                done = 0
                while done < len(view):
                    done += os.pwrite(self._fds[f.name], view[done:], offset + done)
                offset += len(view)
        except OSError as e:
            self._drop(f"writing {self._tmp / f.name} failed: {e.strerror or e}")
            return
        with self._lock:
            self._seen[f.name].update(range(first, -(-offset // f.chunk_bytes)))

    def finish(self) -> bool:
        """Commit the copy if every block arrived (fsync, manifest last, rename); else remove it.

        Returns:
            Whether ``root`` holds the checkpoint now (this copy, or one another process put there).
        """
        try:
            missing = [f.name for f in self._manifest.files if len(self._seen[f.name]) != len(f.chunks)]
            if self.failed or missing:
                if missing and not self.failed:
                    log.debug("[step=%d] the load read only part of %s: no local copy", self._manifest.step, missing)
                return False
            for fd in self._fds.values():
                os.fsync(fd)
            path = self._tmp / MANIFEST_NAME
            path.write_bytes(self._manifest.to_bytes())
            with open(path, "rb+") as fh:
                os.fsync(fh.fileno())
            fsync_dir(self._tmp)
            final = self._root / checkpoint_dirname(self._manifest.step)
            try:
                os.rename(self._tmp, final)
            except OSError as e:
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                return True  # another process (a rank on this node) put its copy there first
            fsync_dir(self._root)
            log.info("[step=%d] the streamed restore left a local copy in %s", self._manifest.step, final)
            return True
        except OSError as e:
            log.warning("[step=%d] could not commit the local copy in %s (%s); it is removed, the load was not "
                        "affected", self._manifest.step, e.filename or self._tmp, e.strerror or e)
            return False
        finally:
            self._close()

    def abandon(self) -> None:
        """The load failed: remove the copy now."""
        self.failed = True
        self._close()

    def _drop(self, why: str) -> None:
        with self._lock:  # once, however many read threads fail at once
            first, self.failed = not self.failed, True
        if first:
            log.warning("[step=%d] no local copy of this restore in %s: %s; the load goes on from memory (what was "
                        "written is removed; free space there for the next restore to find it on disk)",
                        self._manifest.step, self._root, why)

    def _close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._owned.close()  # removes whatever was not renamed into place, then the mark


#: Room left beside a local copy: its manifest, and a little for whatever else writes there.
_HEADROOM_BYTES = 1 << 20


def _short_of_space(root: Path, nbytes: int) -> str | None:
    """Why a copy of ``nbytes`` will not fit in ``root``'s file system, or ``None`` (also when it cannot tell)."""
    try:
        st = os.statvfs(root)
    except OSError:
        return None
    free = st.f_bavail * st.f_frsize
    if free >= nbytes + _HEADROOM_BYTES:
        return None
    return f"the checkpoint takes {nbytes} bytes and its file system has {free} free"
