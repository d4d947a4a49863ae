"""The memory tier's directories and files, hardened as ``local_dir`` is (issue 53, items 4 and 5).

Anyone who can write into ``/dev/shm`` can make ``<run-id>`` there first, or plant a link where a directory of ours
goes. So every directory from the run's down (``<run-id>``, ``rank-R`` or ``partner-of-rank-R``, ``life-...``), every
slot and every record is read, written into or removed only when it is this user's own (:func:`ours`): not a
symbolic link, owned by ``os.geteuid()``, writable by no group or other. Anything else is skipped, with one warning
naming it and the fix. The tier makes its directories 0700 (:func:`make_dir`) and its files 0600. The default base is
per user (:func:`default_base`), so the first user of a machine locks no other out.

A snapshot belongs to one incarnation of ``local_dir``: :func:`local_dir_identity` is a random token made once in
``local_dir`` (``.local-dir-id``, created with the first engine that has a memory tier there); each life records
the identity it was made for, and is read only by a store of that identity. An erased and re-created ``local_dir``
has a new one.

A life is removed oldest record first (:func:`remove_life`), so a process killed in the middle leaves its newest
snapshot readable.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path

from persist_core.errors import ConfigError
from persist_core.layout import LOCAL_DIR_ID_NAME, SLOT_RECORD_SUFFIX, local_dir_identity_value, memory_base_dirname
from persist_core.sidefiles import open_side_file, read_side_file, warn_once

log = logging.getLogger(__name__)

_FIX = ("torch-persist's memory directories are this user's alone (made 0700, files 0600): remove it, or pass "
        "MemoryTier(memory_dir=...) a directory of your own")


def default_base() -> Path:
    """The default base of the memory tier: ``/dev/shm/torch-persist-<uid>``; where there is no ``/dev/shm`` (a
    laptop), the same name in the temporary directory."""
    shm = "/dev/shm"
    return Path(shm if os.path.isdir(shm) else tempfile.gettempdir()) / memory_base_dirname(_uid())


def _uid() -> int:
    return os.geteuid() if hasattr(os, "geteuid") else 0


def _why_not_ours(st: os.stat_result, *, directory: bool) -> str | None:
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link (never followed)"
    if directory and not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if not directory and not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    if st.st_uid != _uid():
        return f"it is owned by uid {st.st_uid}, not this user (uid {_uid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"it is writable by group or others (mode {oct(stat.S_IMODE(st.st_mode))})"
    return None


def ours(path: Path, *, directory: bool = True) -> bool:
    """Whether ``path`` is this user's own directory (``directory``) or regular file, reached without a link: else
    (and it exists) one warning naming it, why and the fix."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    why = _why_not_ours(st, directory=directory)
    if why is not None:
        warn_once(log, os.fspath(path), "memory snapshots in %s are not read: %s; %s", os.fspath(path), why, _FIX)
    return why is None


def all_ours(paths: Iterable[Path]) -> bool:
    return all(ours(p) for p in paths)


def make_dir(path: Path) -> None:
    """Make ``path`` (mode 0700) unless it is there; either way it must be this user's own.

    Raises:
        ConfigError: it cannot be made, or it is not this user's own (named, with the fix).
    """
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise ConfigError(f"cannot make the memory tier's directory {path} ({e.strerror or e}); pass "
                          "MemoryTier(memory_dir=...) a writable tmpfs") from e
    try:
        why = _why_not_ours(os.lstat(path), directory=True)
    except OSError as e:
        why = e.strerror or str(e)
    if why is not None:
        raise ConfigError(f"{path} cannot hold memory snapshots: {why}; {_FIX}")


def read_own_file(path: Path) -> bytes:
    """The bytes of ``path``, a regular file of this user's own that nobody else may write (never through a link).

    Raises:
        OSError: it cannot be read.
        ConfigError: it is a link, or not this user's own (named).
    """
    fd = open_side_file(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        why = _why_not_ours(os.fstat(fd), directory=False)
        if why is not None:
            raise ConfigError(f"{path} is not read: {why}; {_FIX}")
        return f.read()


def remove_life(life: Path, slots_oldest_first: list[Path]) -> None:
    """Remove the slot directory ``life``: each of ``slots_oldest_first``'s record then its slot, then the rest; a
    kill in the middle leaves the newest snapshot whole. Never through a link (``life``'s parents are checked)."""
    if not ours(life):
        return
    for slot in slots_oldest_first:
        for path in (record_of(slot), slot):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as e:
                log.debug("cannot remove %s: %s", path, e)
    shutil.rmtree(life, ignore_errors=True)
    log.debug("removed the memory snapshots in %s", life)


def record_of(slot: Path) -> Path:
    """The commit record of ``slot``."""
    return slot.with_name(slot.name + SLOT_RECORD_SUFFIX)


def local_dir_identity(root: Path, *, create: bool) -> str | None:
    """The identity of this incarnation of ``local_dir`` (``root/.local-dir-id``); ``create``: made once when
    there is none (several ranks on one ``local_dir`` agree: the first link wins). ``None``: none (not ``create``).

    Raises:
        ConfigError: a link or another kind of file is where it goes (named).
    """
    path = root / LOCAL_DIR_ID_NAME
    value = _read_identity(path)
    if value is not None or not create:
        return value
    tmp = root / f"{LOCAL_DIR_ID_NAME}.tmp-{secrets.token_hex(6)}"
    fd = open_side_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(local_dir_identity_value(secrets.token_hex(16)).encode())
        try:
            os.link(tmp, path)  # never replaces one there (another rank's): that one is read back
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)
    value = _read_identity(path)
    if value is None:
        raise ConfigError(f"{path} holds no identity of local_dir: remove it (a new one is made)")
    return value


def _read_identity(path: Path) -> str | None:
    try:
        value = read_side_file(path).decode().strip()
    except FileNotFoundError:
        return None
    except UnicodeDecodeError:
        return None
    return value or None
