"""The memory tier (issue 42): snapshots in host shared memory that outlives the process.

:class:`MemoryTier` is what a user configures (``CheckpointEngine(local_dir, memory=MemoryTier(every_n_steps=1))``);
:class:`MemoryStore` is one rank's snapshots on that memory, bytes only: the slot files the staging buffers are
mapped from (:class:`~persist_core.save.allocators.FileAllocator`), each slot's commit record (the manifest of the
snapshot it holds, written after its bytes and removed before they are overwritten), listing and reading them.

Layout (:mod:`persist_core.layout`): ``memory_dir/<run-id>/rank-R/life-<token>/slot-N`` and ``slot-N.json``. Each
engine maps its slots in a directory of its own (``life-...``), ``flock``-ed while it lives, so a restart reads the
killed process's slots while it maps new ones; the older lives are removed once the new one has a snapshot.

A process killed in the middle of a fill leaves that slot without a record (the record goes first), so the other
slots are what a restart reads; every byte read is checked against the record's checksums.
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from persist_core.errors import ConfigError, CorruptCheckpointError
from persist_core.format.manifest import Manifest
from persist_core.layout import (DEFAULT_MEMORY_DIR, LOCAL_DIR_NAME, SLOT_RECORD_SUFFIX, is_life_dirname,
                                 life_dirname, memory_rank_dirname, parse_partner_dirname, parse_slot_record_name,
                                 partner_dirname)
from persist_core.sidefiles import is_link, read_side_file, write_side_file

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryTier:
    """Snapshots in host memory that outlives the process: a restart on the same machine after a crash resumes
    from the last snapshot (at most ``every_n_steps`` steps lost) without reading the disk.

    ``engine.maybe_save(make_state, step)`` snapshots every ``every_n_steps`` steps; the engine's ``save_policy``
    picks which steps also go to disk (without one, disk saves happen on an explicit ``save()`` only). Each
    snapshot costs one copy of the state into shared memory (the staging copy a disk save makes anyway).

    Args:
        every_n_steps: snapshot every this many steps (1: every step).
        memory_dir: a tmpfs to keep the snapshots in (default ``/dev/shm/torch-persist``); it needs room for
            ``max_pending + 2`` copies of each rank's state, and with several nodes two more of each partner's (the
            copies this node holds for the previous node's ranks). Where it has less, the engine warns once and
            saves to disk only (partner copies: dropped, said once).

    Several ranks: each snapshots its whole state; ``engine.load()`` agrees on the newest step every rank has whole.
    Several nodes: each rank's newest snapshot is also copied to its partner (the same local rank on the next
    node), so a lost node restores from the other node's memory (:mod:`persist_core.sync.partner`).
    """

    every_n_steps: int = 1
    memory_dir: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        n = self.every_n_steps
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"MemoryTier(every_n_steps={n!r}) must be a positive int (1: a snapshot every step)")
        if self.memory_dir is not None and not isinstance(self.memory_dir, (str, os.PathLike)):
            raise ConfigError(f"MemoryTier(memory_dir={self.memory_dir!r}) must be a path to a tmpfs directory "
                              f"(default {DEFAULT_MEMORY_DIR}) or None")

    @property
    def base(self) -> Path:
        """Where every run's snapshots live."""
        return Path(os.fspath(self.memory_dir or DEFAULT_MEMORY_DIR)).expanduser().absolute()

    def due(self, step: int) -> bool:
        """Whether ``step`` is a snapshot step."""
        return step % self.every_n_steps == 0

    def store(self, run_id: str, rank: int, local_dir: Path) -> MemoryStore:
        return MemoryStore(self.base / run_id / memory_rank_dirname(rank), local_dir=local_dir)

    def partner_store(self, run_id: str, of_rank: int, local_dir: Path) -> MemoryStore:
        """The copies of rank ``of_rank``'s snapshots that this node holds as its partner."""
        return MemoryStore(self.base / run_id / partner_dirname(of_rank), local_dir=local_dir)


def check_memory(value: Any) -> MemoryTier | None:
    """``value`` as the ``memory`` option, or a ConfigError naming it."""
    if value is None or isinstance(value, MemoryTier):
        return value
    raise ConfigError(f"memory={value!r} must be a MemoryTier (from persist_core import MemoryTier; "
                      "memory=MemoryTier(every_n_steps=1)) or None")


def memory_tier(every_n_steps: int | None, memory_dir: str | os.PathLike[str] | None) -> MemoryTier | None:
    """The adapters' two keywords (``memory_every_n_steps``, ``memory_dir``) as the ``memory`` option."""
    if every_n_steps is None:
        if memory_dir is not None:
            raise ConfigError(f"memory_dir={os.fspath(memory_dir)!r} was given without memory_every_n_steps; pass "
                              "memory_every_n_steps=1 (a snapshot in memory every step) or drop memory_dir")
        return None
    if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1:
        raise ConfigError(f"memory_every_n_steps={every_n_steps!r} must be a positive int (1: a snapshot every step)")
    return MemoryTier(every_n_steps=every_n_steps, memory_dir=memory_dir)


@dataclass(frozen=True)
class Snapshot:
    """A committed snapshot: its manifest and the slot file holding its shard image."""

    manifest: Manifest
    path: Path

    @property
    def step(self) -> int:
        return self.manifest.step


class MemoryStore:
    """One rank's snapshots under ``root`` (``memory_dir/<run-id>/rank-R``) of the engines on ``local_dir`` (each
    life names its ``local_dir``: two jobs that share a launcher's run id never read or remove each other's)."""

    def __init__(self, root: Path, *, local_dir: Path | None = None) -> None:
        self.root = root
        self.local_dir = None if local_dir is None else os.path.realpath(local_dir)
        self.life: Path | None = None  # this engine's slots (open_life)
        self._lock_fd: int | None = None

    # ---- the writing engine's own life

    def open_life(self) -> Path:
        """Make (mode 0700, never through a link) and lock this engine's slot directory; its path.

        Raises:
            ConfigError: a link is planted on the way, or the directory cannot be made (named, with the fix).
        """
        if self.life is not None:
            return self.life
        for d in (self.root.parent, self.root):  # memory_dir itself is the user's to choose
            if is_link(d):
                raise ConfigError(f"{d} is a symbolic link; the memory tier never follows links there: remove it "
                                  "or pass MemoryTier(memory_dir=...) elsewhere")
        life = self.root / life_dirname(secrets.token_hex(8))
        try:
            life.mkdir(mode=0o700, parents=True)
            fd = os.open(life, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise ConfigError(f"cannot make the memory tier's directory {life} ({e.strerror or e}); pass "
                              "MemoryTier(memory_dir=...) a writable tmpfs") from e
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # while this engine lives: another never removes it
        if self.local_dir is not None:
            write_side_file(life / LOCAL_DIR_NAME, self.local_dir.encode())
        self.life, self._lock_fd = life, fd
        return life

    def free_bytes(self) -> int:
        """Room left on the memory tier's file system."""
        st = os.statvfs(self.life or self.root)
        return st.f_bavail * st.f_frsize

    def commit(self, slot: Path, manifest: Manifest) -> None:
        """The bytes of ``slot`` are ``manifest``'s snapshot: write its record (one rename)."""
        write_side_file(_record(slot), manifest.to_bytes())

    def drop(self, slot: Path) -> None:
        """``slot`` is about to be overwritten: its record goes first."""
        _record(slot).unlink(missing_ok=True)

    def drop_newer(self, step: int) -> None:
        """A snapshot of ``step`` was committed: records of newer steps are a branch the run went back from
        (a resume from an older step), never to be restored; they go."""
        for snap in self.snapshots():
            if snap.step > step:
                self.drop(snap.path)

    def remove_other_lives(self) -> None:
        """Remove the slots of earlier engines that no live process holds (a restart read what it needed)."""
        for life in self._lives():
            if life != self.life and _unlocked(life):
                _remove(life)

    def close(self, *, remove: bool) -> None:
        """Release this engine's lock; ``remove``: the run finished, its snapshots (every life no live process
        holds) go, and the run's directories once empty."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        if not remove:
            return
        if self.life is not None:  # its own, even if a forked child (a DataLoader worker) still holds the lock
            _remove(self.life)
        for life in self._lives():
            if _unlocked(life):
                _remove(life)
        for d in (self.root, self.root.parent):
            try:
                d.rmdir()
            except OSError:
                break  # another rank's or life's are there

    # ---- reading (any process)

    def snapshots(self, lives: list[Path] | None = None) -> list[Snapshot]:
        """Every committed snapshot (of ``lives``; default: all of this rank's) whose record reads and whose slot
        is as large as it says, newest first (a torn or overwritten one has no record; one whose bytes do not
        check fails its read)."""
        found = []
        for life in self._lives() if lives is None else lives:
            try:
                names = os.listdir(life)
            except OSError:
                continue
            for name in names:
                slot_name = parse_slot_record_name(name)
                if slot_name is None:
                    continue
                slot = life / slot_name
                try:
                    manifest = Manifest.from_bytes(read_side_file(life / name), where=str(life / name))
                    size = os.lstat(slot).st_size
                except (OSError, CorruptCheckpointError, ConfigError) as e:
                    log.debug("memory snapshot record %s skipped: %s", life / name, e)
                    continue
                if len(manifest.files) == 1 and manifest.files[0].size <= size:
                    found.append((manifest.step, _written_ns(life / name), Snapshot(manifest, slot)))
        return [s for _, _, s in sorted(found, key=lambda t: t[:2], reverse=True)]  # the newest first, per step too

    def steps(self) -> set[int]:
        return {s.step for s in self.snapshots()}

    def _lives(self) -> list[Path]:
        try:
            names = os.listdir(self.root)
        except OSError:
            return []
        lives = [self.root / n for n in names if is_life_dirname(n) and not is_link(self.root / n)]
        return [life for life in lives if self.local_dir is None or _local_dir_of(life) in (None, self.local_dir)]


def _local_dir_of(life: Path) -> str | None:
    """The ``local_dir`` whose engine mapped ``life`` (``None``: not said)."""
    try:
        return read_side_file(life / LOCAL_DIR_NAME).decode()
    except (OSError, UnicodeDecodeError, ConfigError):
        return None


def _written_ns(path: Path) -> int:
    try:
        return os.lstat(path).st_mtime_ns
    except OSError:
        return 0


def _record(slot: Path) -> Path:
    return slot.with_name(slot.name + SLOT_RECORD_SUFFIX)


def _unlocked(life: Path) -> bool:
    """No live process holds ``life`` (its engine closed or died)."""
    try:
        fd = os.open(life, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _remove(life: Path) -> None:
    if is_link(life):
        return
    shutil.rmtree(life, ignore_errors=True)
    log.debug("removed the memory snapshots in %s", life)


def run_lives(base: Path, run_id: str, local_dir: Path | None = None) -> list[tuple[Path, bool, list[Snapshot]]]:
    """Every slot directory of run ``run_id`` under ``base`` (each rank's, each engine's, and the partner copies this
    node holds for other ranks, ``partner-of-rank-R``): its path, whether a live process holds it, and its committed
    snapshots (newest first)."""
    run = base / run_id
    if is_link(run):
        return []
    try:
        ranks = [run / n for n in sorted(os.listdir(run))
                 if (n.startswith("rank-") or parse_partner_dirname(n) is not None) and not is_link(run / n)]
    except OSError:
        return []
    found = []
    for rank in ranks:
        store = MemoryStore(rank, local_dir=local_dir)
        for life in sorted(store._lives()):
            found.append((life, not _unlocked(life), store.snapshots([life])))
    return found


def remove_stale(base: Path, run_id: str, local_dir: Path | None = None, *, dry_run: bool = False) -> list[Path]:
    """Remove (``dry_run``: only name) the slot directories of run ``run_id`` (``local_dir``'s) that no live
    process holds."""
    stale = [life for life, live, _ in run_lives(base, run_id, local_dir) if not live]
    if not dry_run:
        for life in stale:
            _remove(life)
    return stale
