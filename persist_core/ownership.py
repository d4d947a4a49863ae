"""Who owns what in ``local_dir``: the writer lock of each rank and the owner mark of each temporary
directory. (The record of checkpoints not yet uploaded is :mod:`persist_core.sync.record`'s.)

Liveness is an ``flock`` held by a live process, never a PID: a PID says nothing across hosts
(a shared file system) or PID namespaces (containers), and PIDs are reused. The kernel drops a
process's locks when it dies, however it dies (SIGKILL included).

* **Writer lock** (:class:`DirLock`): one writer per directory and per rank. ``.lock-rank-R`` is
  held with ``LOCK_EX`` for the engine's life and holds its holder's host, pid and start time, so
  the error a second writer gets names who holds it. The file is never unlinked (unlinking a lock
  file races with the next taker). Readers take no lock.
* **Owner mark** (:func:`claim_tmp`): every temporary directory (a checkpoint being written, a
  download, a checkpoint being deleted) has an ``.owner`` file next to it, created and locked
  *before* the directory and unlinked *after* the directory is renamed or removed. A temporary
  directory whose mark nobody holds, or that has none, is dead: :func:`remove_dead` removes it.
* **Links are not ours.** Anyone who can write into a shared directory can plant a symbolic link where
  a file or directory of ours goes. Side files are opened without following links
  (:mod:`persist_core.sidefiles`; temporaries are created with ``O_EXCL``), so a link there is a
  :class:`ConfigError` naming it instead of a write to its target; a link where a checkpoint or a
  temporary directory goes is never followed, renamed or removed: it is skipped, with one warning.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import shutil
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from persist_core.errors import ConfigError, DirectoryInUseError
from persist_core.fileio import fsync_dir
from persist_core.layout import (
    OWNER_SUFFIX,
    lock_filename,
    owner_filename,
    parse_checkpoint_dirname,
    parse_lock_filename,
    parse_tmp_dirname,
    tmp_dirname,
)
from persist_core.sidefiles import (
    is_link,
    linked,
    open_side_file,
    read_side_file,
)

log = logging.getLogger(__name__)

_TAKE_TRIES = 20  # a probe by ``persist gc`` holds a lock for microseconds: try again a little

def _identity() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime())}


def describe(holder: dict[str, Any] | None) -> str:
    """``host=... pid=... since ...`` of a lock record (what an error shows)."""
    if not holder:
        return "a process that has not written its name yet"
    return f"host={holder.get('host')} pid={holder.get('pid')} since {holder.get('started')}"


def _read_record(fd: int) -> dict[str, Any] | None:
    try:
        data = json.loads(os.pread(fd, 1 << 16, 0) or b"null")
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _held_by_other(path: Path) -> tuple[bool, dict[str, Any] | None]:
    """``(locked by a live process, its record)`` for a lock file, taking the lock for an instant only."""
    try:
        fd = open_side_file(path, os.O_RDONLY | os.O_NONBLOCK)
    except (FileNotFoundError, ConfigError):  # a link is nobody's lock
        return False, None
    try:
        record = _read_record(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True, record
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False, record
    finally:
        os.close(fd)


@dataclass
class DirLock:
    """This process's writer lock on ``local_dir`` for one rank (see :func:`take`)."""

    path: Path
    fd: int | None

    def release(self) -> None:
        """Drop the lock (idempotent); the file stays for the next writer."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __del__(self) -> None:  # one dropped unreleased (an engine whose construction failed after taking it)
        self.release()


def take(root: Path, rank: int) -> DirLock:
    """Take the writer lock of ``rank`` on ``root`` and write this process's name into it.

    Raises:
        DirectoryInUseError: a live process holds it (the message names host, pid and start time).
        ConfigError: a symbolic link is where the lock file goes (named).
    """
    path = root / lock_filename(rank)
    fd = open_side_file(path, os.O_RDWR | os.O_CREAT)
    try:
        for attempt in range(_TAKE_TRIES):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if attempt == _TAKE_TRIES - 1:
                    holder = _read_record(fd)
                    ours = holder is not None and holder.get("pid") == os.getpid() and \
                        holder.get("host") == socket.gethostname()
                    fix = ("close the other CheckpointEngine on it first (this process opened it), or read with "
                           "CheckpointReader, which takes no lock") if ours else (
                        "give this job its own local_dir, or stop the other job first (a crashed one holds "
                        "nothing: its lock went with it)")
                    error = DirectoryInUseError(
                        f"local_dir={str(root)!r} is in use by another writer for rank {rank}: {describe(holder)}. "
                        f"Two writers on one directory would delete each other's checkpoints; {fix}")
                    error.this_process = ours
                    raise error from None
                time.sleep(0.005)
        body = json.dumps({**_identity(), "rank": rank}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, body, 0)
    except BaseException:
        os.close(fd)
        raise
    return DirLock(path, fd)


def live_writers(root: Path) -> dict[int, dict[str, Any] | None]:
    """The ranks whose writer lock on ``root`` a live process holds, with its record."""
    found = {}
    for entry in os.scandir(root):
        rank = parse_lock_filename(entry.name)
        if rank is not None:
            held, record = _held_by_other(Path(entry.path))
            if held:
                found[rank] = record
    return found


def _new_mark(mark: Path) -> int:
    """Create ``mark`` already locked, with this process's name in it; its fd.

    Where the file system takes ``O_TMPFILE``, the mark is locked and written before it gets its
    name, so a mark found unlocked is dead at once (``"whole": true``). Elsewhere it is created, then
    locked: one found unlocked and empty may be a moment old, and is left for a minute.
    """
    record = _identity()
    try:
        fd = os.open(mark.parent, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o644)
    except (AttributeError, OSError):
        fd = None
    if fd is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.pwrite(fd, json.dumps({**record, "whole": True}).encode(), 0)
            proc = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:  # a dir fd makes os.link use linkat(AT_SYMLINK_FOLLOW): the open file itself gets the name
                os.link(str(fd), mark, src_dir_fd=proc, follow_symlinks=True)
            finally:
                os.close(proc)
            return fd
        except OSError:
            os.close(fd)
    fd = open_side_file(mark, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.pwrite(fd, json.dumps(record).encode(), 0)
    except BaseException:  # a full disk: no mark left behind, nor its locked descriptor
        os.close(fd)
        with contextlib.suppress(OSError):
            mark.unlink()
        raise
    return fd


@contextlib.contextmanager
def claim_tmp(root: Path, step: int, name: str | None = None) -> Iterator[Path]:
    """A new temporary directory under ``root`` for ``step``, owned (marked) while the block runs.

    The mark is created and locked before the directory exists and unlinked after the block, by
    which time the directory was renamed into place or removed; whatever the block leaves under
    the temporary name is dead once it ends, and removed now. ``name``: the one rank 0 chose (a
    node's leader claims it on its own disk; the node's other ranks may have made it already).
    """
    shared = name is not None
    name = name or tmp_dirname(step, os.getpid(), secrets.token_hex(3))
    mark = root / owner_filename(name)
    fd = _new_mark(mark)
    try:
        os.makedirs(root / name, exist_ok=shared)
        if shared and os.path.islink(root / name):  # exist_ok takes a link to a directory: not ours
            raise linked(root / name)
        try:
            yield root / name
        finally:
            shutil.rmtree(root / name, ignore_errors=True)  # nothing, when the block renamed it
    finally:
        mark.unlink(missing_ok=True)
        os.close(fd)


def _owner_alive(root: Path, name: str) -> tuple[bool, int | None]:
    """``(a live process owns tmp ``name``, the fd of its mark locked by us, or None)``."""
    try:
        fd = open_side_file(root / owner_filename(name), os.O_RDONLY | os.O_NONBLOCK)
    except (FileNotFoundError, ConfigError):  # a link is no mark: nobody owns the directory
        return False, None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return True, None
    return False, fd


_STRAY_MARK_AGE_S = 60.0  # a mark without its directory may be one being claimed right now


def dead_tmp(root: Path) -> list[Path]:
    """Temporary directories (and stray marks) under ``root`` that no live process owns."""
    names = {e.name for e in os.scandir(root)}
    dead = []
    for name in sorted(names):
        base = name.removesuffix(OWNER_SUFFIX)
        if parse_tmp_dirname(base) is None or (name != base and base in names):
            continue
        if name == base and is_link(root / name):  # not ours: never removed
            continue
        if name != base and not _whole(root / name) and _age(root / name) < _STRAY_MARK_AGE_S:
            continue  # maybe created, not yet locked: its directory comes next
        alive, fd = _owner_alive(root, base)
        if fd is not None:
            os.close(fd)
        if not alive:
            dead.append(root / name)
    return dead


def _whole(mark: Path) -> bool:
    """The mark was locked before it had its name (so unlocked means dead)."""
    try:
        return bool(json.loads(read_side_file(mark) or b"{}").get("whole"))
    except (OSError, ValueError, AttributeError):  # ConfigError (a link) is a ValueError
        return False


def _age(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return float("inf")


def remove_dead(root: Path, *, rank: int) -> list[Path]:
    """Remove every temporary directory under ``root`` whose owner is gone; what was removed.

    Each is removed while holding its mark, so its owner cannot be alive meanwhile.
    """
    removed = []
    for path in dead_tmp(root):
        base = path.name.removesuffix(OWNER_SUFFIX)
        alive, fd = _owner_alive(root, base)
        if alive:
            continue
        try:
            if (root / base).exists():
                log.info("[rank=%d] removing %s left by a process that is gone", rank, root / base)
                shutil.rmtree(root / base, ignore_errors=True)
            (root / owner_filename(base)).unlink(missing_ok=True)
            removed.append(path)
        finally:
            if fd is not None:
                os.close(fd)
    return removed


def owner_of(root: Path, tmp: Path) -> dict[str, Any] | None:
    """The record of the live owner of temporary directory ``tmp``, or ``None`` when it is dead."""
    held, record = _held_by_other(root / owner_filename(tmp.name))
    return (record or {}) if held else None


def discard(root: Path, ckpt: Path) -> None:
    """Remove ``ckpt`` (a directory under ``root``) so that a crash part-way leaves only dead temporaries.

    One rename takes it out of the checkpoints (made durable), then it is deleted under an owner mark.
    A symbolic link is not ours: left alone (:func:`is_link`).
    """
    if is_link(ckpt):
        return
    with claim_tmp(root, parse_checkpoint_dirname(ckpt.name) or 0) as trash:
        os.rmdir(trash)
        try:
            os.rename(ckpt, trash)
        except FileNotFoundError:
            return  # another process removed it first
        fsync_dir(root)
        shutil.rmtree(trash)
