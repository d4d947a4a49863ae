"""The memory tier (issue 42): snapshots in host shared memory that outlives the process.

:class:`MemoryTier` is what a user configures (``CheckpointEngine(local_dir, memory=MemoryTier(every_n_steps=1))``);
:class:`MemoryStore` is one rank's snapshots on that memory, bytes only: the slot files the staging buffers are
mapped from (:class:`~persist_core.staging.allocators.FileAllocator`), each slot's commit record (the manifest of the
snapshot it holds, written after its bytes and removed before they are overwritten), listing and reading them.

Layout (:mod:`persist_core.layout`): ``memory_dir/<run-id>/rank-R/life-<token>/slot-N`` and ``slot-N.json``. Each
engine maps its slots in a directory of its own (``life-...``), ``flock``-ed while it lives (and marked ``.closed``
when it closes: a child process it forked shares the lock, a DataLoader worker for its life, a subprocess until its
exec, and may hold it past the close), so a restart reads the killed process's slots while it maps new ones; the older lives are removed once the new one has a snapshot (or a
disk checkpoint holds their step, at a clean close). Every directory and file is this user's own, never reached
through a link, and each life belongs to one incarnation of ``local_dir``
(:mod:`persist_core.memory.files`).

A process killed in the middle of a fill leaves that slot without a record (the record goes first), so the other
slots are what a restart reads; every byte read is checked against the record's checksums.
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from persist_core.errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError
from persist_core.format.manifest import FileEntry, Manifest
from persist_core.layout import (CLOSED_NAME, IDENTITY_NAME, LOCAL_DIR_NAME, is_life_dirname, life_dirname,
                                 parse_slot_record_name)
from persist_core.sidefiles import open_side_file, warn_once, write_side_file
from persist_core.tiers.local import ShardFile, read_blocks
from persist_core.tiers.tier import CheckpointInfo
from persist_core.memory.files import (all_ours, make_dir, ours, read_own_file,
                                             record_of, remove_life)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Snapshot:
    """A committed snapshot: its manifest and the slot file holding its shard image (or a partner's copy pulled
    back into a file of its own). The read side of one copy (:class:`~persist_core.tiers.tier.HostReader`): a load
    reads it as it reads any copy on this host."""

    manifest: Manifest
    path: Path
    kind: ClassVar[str] = "memory"

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def location(self) -> str:
        return str(self.path)

    @property
    def info(self) -> CheckpointInfo:
        """As a listing gives it (``tier="memory"``, ``path`` the slot)."""
        return CheckpointInfo(step=self.step, time=self.manifest.time, nbytes=self.manifest.nbytes,
                              path=str(self.path), tier="memory")

    def committed_steps(self) -> list[int]:
        return [self.step]

    def list(self) -> list[CheckpointInfo]:
        return [self.info]

    def read_manifest(self, step: int) -> Manifest:
        self._check(step)
        return self.manifest

    def read_blocks(self, step: int, f: FileEntry, first: int, views: list[memoryview], *, verify: bool = True) -> None:
        """Fill ``views`` with whole checksum blocks of the image from block ``first`` on, each verified."""
        self._check(step)
        read_blocks(self.path, f, first, views, verify=verify)

    def open_file(self, step: int, f: FileEntry) -> ShardFile:
        """The image open for a whole read (the slot may be longer than the image: it is the size of the largest
        snapshot it held)."""
        self._check(step)
        try:
            return ShardFile(self.path, f, at_least=True)
        except OSError as e:
            raise CorruptCheckpointError(f"memory snapshot {self.path} cannot be read ({e.strerror or e})") from e

    def copies(self, step: int) -> list[Snapshot]:
        return [self] if step == self.step else []

    def _check(self, step: int) -> None:
        if step != self.step:
            raise CheckpointNotFoundError(f"memory snapshot {self.path} holds step={self.step}, not step={step}")


class MemoryStore:
    """One rank's snapshots under ``root`` (``memory_dir/<run-id>/rank-R``) of the engines of ``identity`` (each
    life records the identity it was made for, :mod:`persist_core.memory.files`: the incarnation of
    ``local_dir``, so two jobs that share a launcher's run id, or a ``local_dir`` erased and made again, never read
    each other's; ``None``: every life, for listing). ``local_dir``: the path the lives name (which a life of an
    earlier incarnation of it names too: ``persist gc --memory`` removes those). ``check_base``: the base is the
    default one, checked as this user's own as the directories below it are."""

    def __init__(self, root: Path, *, identity: str | None, local_dir: Path | None = None,
                 check_base: bool = False) -> None:
        self.root = root
        self.identity = identity
        self.local_dir = None if local_dir is None else os.path.realpath(local_dir)
        self._check_base = check_base
        self.life: Path | None = None  # this engine's slots (open_life)
        self._lock_fd: int | None = None
        self._parsed: dict[bytes, Manifest] = {}  # the records the last listing read: a load lists them often

    def _dirs(self) -> list[Path]:
        """The directories above the lives, from the base (the default one) down."""
        run = self.root.parent
        return [run.parent, run, self.root] if self._check_base else [run, self.root]

    # ---- the writing engine's own life

    def open_life(self) -> Path:
        """Make (mode 0700, each directory this user's own, never through a link) and lock this engine's slot
        directory; its path.

        Raises:
            ConfigError: a directory on the way is a link or not this user's own, or cannot be made (named, with the
                fix).
        """
        if self.life is not None:
            return self.life
        base = self.root.parent.parent
        try:  # a memory_dir the user chose: made as asked, its parents too
            base.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot make the memory tier's directory {base} ({e.strerror or e}); pass "
                              "MemoryTier(memory_dir=...) a writable tmpfs") from e
        for d in self._dirs():
            make_dir(d)
        life = self.root / life_dirname(secrets.token_hex(8))
        make_dir(life)
        try:
            fd = os.open(life, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise ConfigError(f"cannot open the memory tier's directory {life} ({e.strerror or e})") from e
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # while this engine lives: another never removes it
        if self.identity is not None:
            write_side_file(life / IDENTITY_NAME, self.identity.encode(), mode=0o600)
        if self.local_dir is not None:
            write_side_file(life / LOCAL_DIR_NAME, self.local_dir.encode(), mode=0o600)
        self.life, self._lock_fd = life, fd
        return life

    def free_bytes(self) -> int:
        """Room left on the memory tier's file system."""
        st = os.statvfs(self.life or self.root)
        return st.f_bavail * st.f_frsize

    def commit(self, slot: Path, manifest: Manifest) -> None:
        """The bytes of ``slot`` are ``manifest``'s snapshot: write its record (one rename)."""
        write_side_file(record_of(slot), manifest.to_bytes(), mode=0o600)

    def drop(self, slot: Path) -> None:
        """``slot`` is about to be overwritten: its record goes first."""
        record_of(slot).unlink(missing_ok=True)

    def drop_newer(self, step: int) -> None:
        """A snapshot of ``step`` was committed: records of newer steps are a branch the run went back from
        (a resume from an older step), never to be restored; they go."""
        for snap in self.snapshots():
            if snap.step > step:
                self.drop(snap.path)

    def remove_other_lives(self) -> None:
        """Remove the slots of earlier engines that no live process holds (a restart read what it needed)."""
        self._remove([life for life in self._lives() if life != self.life and _unlocked(life)])

    def close(self, *, remove: bool, others_up_to: int | None = None) -> None:
        """Release this engine's lock; ``remove``: the run finished, this engine's snapshots go, and the run's
        directories once empty; so do those of earlier engines no live process holds whose newest step is at most
        ``others_up_to`` (``None``: every one; this engine's own snapshot superseded them): the only copy of a newer
        step stays (a process that only read it closes well). The oldest go first: a kill in the middle leaves the
        newest."""
        if self._lock_fd is not None:
            assert self.life is not None
            try:  # first: a child forked meanwhile shares the lock, and may hold it past this close
                os.close(open_side_file(self.life / CLOSED_NAME, os.O_WRONLY | os.O_CREAT, 0o600))
            except (OSError, ConfigError) as e:
                log.debug("cannot mark %s closed (its lock alone says so): %s", self.life, e)
            os.close(self._lock_fd)
            self._lock_fd = None
        if not remove:
            return
        lives = [] if self.life is None else [self.life]  # even if a forked child (a DataLoader worker) holds it
        for life in self._lives():
            if life == self.life or not _unlocked(life):
                continue
            newest = max((s.step for s in self.snapshots([life])), default=-1)
            if others_up_to is None or newest <= others_up_to:
                lives.append(life)
            else:
                log.info("kept the memory snapshot of step %d in %s: no snapshot of this process nor a disk "
                         "checkpoint holds that step yet", newest, life)
        self._remove(lives)
        for d in (self.root, self.root.parent):
            try:
                d.rmdir()
            except OSError:
                break  # another rank's or life's are there

    def _remove(self, lives: list[Path]) -> None:
        """Remove ``lives``, the one with the oldest newest snapshot first, each oldest record first."""
        order = sorted(((self.snapshots([life]), life) for life in lives),
                       key=lambda t: t[0][0].step if t[0] else -1)
        for snaps, life in order:
            remove_life(life, [s.path for s in reversed(snaps)])

    # ---- reading (any process)

    def snapshots(self, lives: list[Path] | None = None) -> list[Snapshot]:
        """Every committed snapshot (of ``lives``; default: all of this rank's) whose record reads and whose slot
        is as large as it says, both this user's own, newest first (a torn or overwritten one has no record; one
        whose bytes do not check fails its read)."""
        found, parsed = [], {}
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
                    raw = read_own_file(life / name)
                    manifest = self._parsed.get(raw) or Manifest.from_bytes(raw, where=str(life / name))
                    parsed[raw] = manifest
                    if not ours(slot, directory=False):
                        continue
                    size = os.lstat(slot).st_size
                except ConfigError as e:  # not this user's own, or a link
                    warn_once(log, str(life / name), "%s", e)
                    continue
                except (OSError, CorruptCheckpointError) as e:
                    log.debug("memory snapshot record %s skipped: %s", life / name, e)
                    continue
                if len(manifest.files) == 1 and manifest.files[0].size <= size:
                    found.append((manifest.step, _written_ns(life / name), Snapshot(manifest, slot)))
        self._parsed = parsed  # a record's bytes parsed once while they stay (every listing still reads and checks them)
        return [s for _, _, s in sorted(found, key=lambda t: t[:2], reverse=True)]  # the newest first, per step too

    def steps(self) -> set[int]:
        return {s.step for s in self.snapshots()}

    # ---- the read side of the Tier protocol (a HostReader): a load reads the store as one more source; nothing
    # that prunes or lists checkpoints (the Retainer, persist ls, verify) takes it, as it has no remove

    kind = "memory"

    @property
    def location(self) -> str:
        return str(self.root)

    def committed_steps(self) -> list[int]:
        """Steps with a committed snapshot, ascending."""
        return sorted(self.steps())

    def read_manifest(self, step: int) -> Manifest:
        """The record of the newest slot holding ``step``."""
        return self._snapshot(step).manifest

    def read_blocks(self, step: int, f: FileEntry, first: int, views: list[memoryview], *, verify: bool = True) -> None:
        """Fill ``views`` with whole checksum blocks of ``step``'s image from block ``first`` on, each verified."""
        self._snapshot(step).read_blocks(step, f, first, views, verify=verify)

    def open_file(self, step: int, f: FileEntry) -> ShardFile:
        """The image of the newest slot holding ``step``, open for a whole read."""
        return self._snapshot(step).open_file(step, f)

    def copies(self, step: int) -> list[Snapshot]:
        """Each slot holding ``step``, newest first: one whose bytes do not verify passes the load to the next."""
        return [s for s in self.snapshots() if s.step == step]

    def list(self) -> list[CheckpointInfo]:
        """The committed snapshots, oldest first (``tier="memory"``, ``path`` the slot); a step in two slots twice."""
        return [s.info for s in reversed(self.snapshots())]

    def _snapshot(self, step: int) -> Snapshot:
        found = next(iter(self.copies(step)), None)
        if found is None:
            raise CheckpointNotFoundError(f"no memory snapshot of step={step} in {self.root}")
        return found

    def _all_lives(self) -> list[Path]:
        """Every life under ``root`` that is this user's own (none when a directory above is not)."""
        if not all_ours(self._dirs()):
            return []
        try:
            names = os.listdir(self.root)
        except OSError:
            return []
        return [self.root / n for n in sorted(names) if is_life_dirname(n) and ours(self.root / n)]

    def _lives(self) -> list[Path]:
        """The lives of this store's identity (the others skipped: one log line each, when it may be a user's)."""
        return [life for life in self._all_lives() if self.identity is None or self._mine(life)]

    def _mine(self, life: Path) -> bool:
        identity = _side(life, IDENTITY_NAME)
        if identity == self.identity:
            return True
        if identity is None:
            warn_once(log, str(life), "memory snapshots in %s skipped: they name no identity (an older version's, or "
                      "torn), so no local_dir resumes from them; `persist gc LOCAL_DIR --memory` removes them", life)
        elif self.local_dir is not None and _side(life, LOCAL_DIR_NAME) == self.local_dir:
            warn_once(log, str(life), "memory snapshots in %s skipped: made for an earlier incarnation of %s (erased "
                      "and made again since), never resumed from; `persist gc %s --memory` removes them", life,
                      self.local_dir, self.local_dir)
        else:
            log.debug("memory snapshots in %s are another job's (%s)", life, identity)
        return False

    def orphans(self) -> list[Path]:
        """The lives no ``local_dir`` resumes from that this store's ``local_dir`` answers for: those that name no
        identity, and those made for an earlier incarnation of it."""
        return [life for life in self._all_lives() if (identity := _side(life, IDENTITY_NAME)) is None
                or (identity != self.identity and self.local_dir is not None
                    and _side(life, LOCAL_DIR_NAME) == self.local_dir)]


def _side(life: Path, name: str) -> str | None:
    """What ``life``'s side file ``name`` says (``None``: nothing readable)."""
    try:
        return read_own_file(life / name).decode() or None
    except (OSError, UnicodeDecodeError, ConfigError):
        return None


def _written_ns(path: Path) -> int:
    try:
        return os.lstat(path).st_mtime_ns
    except OSError:
        return 0


def _unlocked(life: Path) -> bool:
    """No live process holds ``life``: its engine closed (marked so: a child it forked may hold the lock still) or
    died (the lock is free)."""
    try:
        if stat.S_ISREG(os.lstat(life / CLOSED_NAME).st_mode):
            return True
    except OSError:
        pass
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
