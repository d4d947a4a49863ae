"""Side files in a directory torch-persist owns (``local_dir``, its sub-tiers, any later tier's), opened
without following links.

Anyone who can write into a shared directory can plant a symbolic link where a file of ours goes; were it
followed, a training job would truncate, overwrite or append to whatever file the job may write. So every
side file is opened with ``O_NOFOLLOW`` (:func:`open_side_file`), read only when it is a regular file
(:func:`read_side_file`: a FIFO or a device never blocks or floods a reader), and replaced through a
temporary created with ``O_EXCL`` (:func:`write_side_file`); a link there is a :class:`ConfigError` naming
it. A link where a directory of ours goes (a checkpoint, a temporary) is not ours: never followed,
renamed or removed, skipped with one warning (:func:`is_link`).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
from pathlib import Path

from persist_core.errors import ConfigError

log = logging.getLogger(__name__)

_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def linked(path: Path | str) -> ConfigError:
    """The error for a symbolic link found where a side file of ours goes."""
    return ConfigError(f"{path} is a symbolic link where torch-persist keeps a file of its own; it never writes "
                       "through or follows links there (the link's target would be overwritten): remove the link")


def not_a_file(path: Path | str) -> ConfigError:
    """The error for something other than a regular file (a directory, a FIFO) where a side file of ours goes."""
    return ConfigError(f"{path} is not a regular file; torch-persist keeps a file of its own there: remove it "
                       "(or move it away)")


def open_side_file(path: Path, flags: int, mode: int = 0o644) -> int:
    """``os.open(path, flags)`` that never follows a link at ``path`` (``O_NOFOLLOW``, close-on-exec).

    Raises:
        ConfigError: ``path`` is a symbolic link (named).
        OSError: as :func:`os.open` (``FileExistsError`` for ``O_EXCL``, even when a link is there).
    """
    try:
        return os.open(path, flags | _NOFOLLOW, mode)
    except OSError as e:
        if e.errno == errno.ELOOP and os.path.islink(path):
            raise linked(path) from None
        raise


def read_side_file(path: Path) -> bytes:
    """The bytes of the side file ``path``: never through a link, never waiting on a FIFO or a device.

    Raises:
        FileNotFoundError: there is none.
        ConfigError: ``path`` is a link, or not a regular file (a directory, a FIFO: named).
    """
    fd = open_side_file(path, os.O_RDONLY | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # before fdopen, which refuses a directory (IsADirectoryError)
        os.close(fd)
        raise not_a_file(path)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def write_side_file(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """Replace the side file ``path`` with ``data`` in one rename, from ``<name>.tmp`` created with ``O_EXCL``
    (one left by a crash is removed first), ``mode`` (less the umask). The rename replaces a link at ``path``
    itself, never its target.

    Raises:
        ConfigError: ``<name>.tmp`` is a link, or ``path`` a directory (named).
    """
    tmp = path.with_name(path.name + ".tmp")
    try:
        fd = open_side_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        if os.path.islink(tmp):
            raise linked(tmp) from None
        tmp.unlink()  # left by a crash: one writer per name (the holder of the directory's writer lock)
        fd = open_side_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        try:
            os.replace(tmp, path)
        except IsADirectoryError:
            raise not_a_file(path) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(logger: logging.Logger, key: str, msg: str, *args: object) -> None:
    """``logger.warning(msg, *args)`` the first time this process meets ``key`` (a path), DEBUG after."""
    with _warned_lock:
        first = key not in _warned
        _warned.add(key)
    logger.log(logging.WARNING if first else logging.DEBUG, msg, *args)


def is_link(path: str | os.PathLike[str]) -> bool:
    """Whether ``path``, a name where torch-persist keeps a directory of its own (a checkpoint, a temporary),
    is a symbolic link: then it is not ours, never followed, renamed or removed; the first time, a warning."""
    if not os.path.islink(path):
        return False
    warn_once(log, os.fspath(path), "skipping %s: a symbolic link where torch-persist keeps directories of its own "
              "(not one it wrote: never followed, renamed or removed)", os.fspath(path))
    return True
