"""The local tier: committed checkpoint directories under ``local_dir``.

Readers never trust a manifest alone: :func:`check_files` checks that every file it names is
there with its size, and the reads (:func:`read_blocks`, :class:`ShardFile`) verify every chunk's crc32c
(unless ``verify=False``), straight into the memory the caller hands them. Bytes only: what the bytes mean
is the load flow's (:mod:`persist_core.load`).
"""

from __future__ import annotations

import logging
import os
import secrets
from collections import deque
from collections.abc import Callable
from pathlib import Path

import crc32c

from persist_core.errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError
from persist_core.fileio import fsync_dir
from persist_core.format.manifest import FileEntry, Manifest
from persist_core.layout import (
    MANIFEST_NAME,
    abandoned_dirname,
    checkpoint_dirname,
    parse_abandoned_dirname,
    parse_checkpoint_dirname,
)
from persist_core.ownership import DirLock, discard, remove_dead, take
from persist_core.sidefiles import is_link, open_side_file
from persist_core.tiers.tier import CheckpointInfo

log = logging.getLogger(__name__)



def checkpoint_dir(root: Path, step: int) -> Path:
    return root / checkpoint_dirname(step)


def committed_steps(root: Path) -> list[int]:
    """Steps of the directories under ``root`` that hold a manifest, ascending (nothing verified). A
    symbolic link named like a checkpoint is not ours: skipped, with one warning."""
    steps = []
    for entry in os.scandir(root):
        step = parse_checkpoint_dirname(entry.name)
        if step is not None and not is_link(entry.path) and os.path.exists(os.path.join(entry.path, MANIFEST_NAME)):
            steps.append(step)
    return sorted(steps)


def read_manifest(ckpt: Path) -> Manifest:
    """The manifest of the checkpoint directory ``ckpt``, with its files checked.

    Raises:
        CheckpointNotFoundError: no manifest, or ``ckpt`` is a symbolic link (never followed).
        CorruptCheckpointError: unreadable manifest, or a file missing or of the wrong size.
    """
    if is_link(ckpt):
        raise CheckpointNotFoundError(f"{ckpt} is a symbolic link, not a checkpoint directory torch-persist wrote "
                                      "(links there are never followed)")
    where = str(ckpt / MANIFEST_NAME)
    try:
        raw = (ckpt / MANIFEST_NAME).read_bytes()
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{ckpt} is not a committed checkpoint (no {MANIFEST_NAME})") from None
    manifest = Manifest.from_bytes(raw, where=where, step=parse_checkpoint_dirname(ckpt.name))
    check_files(ckpt, manifest)
    return manifest


def check_files(ckpt: Path, manifest: Manifest) -> None:
    """Raise :class:`CorruptCheckpointError` unless every file ``manifest`` places in this directory exists
    with its size (a node's copy holds its own ranks' files; the other nodes and the remote hold the rest)."""
    for f in manifest.held():
        try:
            size = os.stat(ckpt / f.name).st_size
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{ckpt / f.name} named by the manifest is missing") from None
        if size != f.size:
            raise CorruptCheckpointError(f"{ckpt / f.name} has {size} bytes; the manifest says {f.size}")


def discover(root: Path) -> list[tuple[CheckpointInfo, Manifest]]:
    """Committed checkpoints under ``root`` whose manifest and file sizes check, ascending by step.

    Ones that do not check are logged at WARNING and left out; one removed since it was listed, at DEBUG.
    """
    found = []
    for step in committed_steps(root):
        ckpt = checkpoint_dir(root, step)
        try:
            manifest = read_manifest(ckpt)
        except CorruptCheckpointError as e:
            log.warning("skipping %s: %s", ckpt, e)
            continue
        except CheckpointNotFoundError as e:  # removed (persist rm, retention) since it was listed
            log.debug("skipping %s: %s", ckpt, e)
            continue
        found.append((CheckpointInfo(step=step, time=manifest.time, nbytes=manifest.nbytes, path=str(ckpt)), manifest))
    return found


def verify_files(ckpt: Path, manifest: Manifest, progress: Callable[[int], None] | None = None) -> list[str]:
    """Read every file of a local checkpoint and check each chunk's crc32c; the problems found.

    Args:
        ckpt: the checkpoint directory.
        manifest: its manifest.
        progress: called with the bytes of each chunk checked.
    """
    problems = []
    for f in manifest.held():
        path = ckpt / f.name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            problems.append(f"{path}: missing")
            continue
        try:
            size = os.fstat(fd).st_size
            if size != f.size:
                problems.append(f"{path}: {size} bytes, the manifest says {f.size}")
                continue
            for i, expected in enumerate(f.chunks):
                data = os.pread(fd, f.chunk_bytes, i * f.chunk_bytes)
                if crc32c.crc32c(data) != expected:
                    problems.append(f"{path}: chunk {i} (bytes {i * f.chunk_bytes}..{i * f.chunk_bytes + len(data)}) "
                                    "does not match its checksum")
                if progress is not None:
                    progress(len(data))
        finally:
            os.close(fd)
    return problems


_IOV_BATCH = 512


def _read_exact(fd: int, views: list[memoryview], offset: int, path: Path) -> None:
    """Fill ``views`` (in file order) from ``offset`` with ``preadv``, however short the reads."""
    queue = deque(v for v in views if len(v))
    while queue:
        batch = [queue.popleft() for _ in range(min(_IOV_BATCH, len(queue)))]
        n = os.preadv(fd, batch, offset)
        if n == 0:
            raise CorruptCheckpointError(f"{path} ended early at byte {offset}")
        offset += n
        while n:  # give back what a short read left unfilled
            head = batch.pop(0)
            if n >= len(head):
                n -= len(head)
            else:
                batch.insert(0, head[n:])
                n = 0
        queue.extendleft(reversed(batch))


def _read_chunk(fd: int, path: Path, views: list[memoryview], offset: int, expected: int | None, index: int) -> None:
    _read_exact(fd, views, offset, path)
    if expected is None:
        return
    crc = 0
    for v in views:
        crc = crc32c.crc32c(v, crc)
    if crc != expected:
        raise CorruptCheckpointError(
            f"{path}: checksum mismatch in chunk {index} (bytes {offset}..{offset + sum(map(len, views))}); "
            "the file is corrupt: load another step, or restore this one from the remote tier"
        )


class ShardFile:
    """One local shard file open for reading, its size checked against the manifest: :meth:`head` and
    :meth:`fill` are what a whole-file read takes (the load flow's ``read_shard``). Use it as a context manager.

    ``at_least``: the file may be longer than the manifest says (a memory tier's slot, whose file is the size of
    the largest snapshot it held).

    Raises:
        CorruptCheckpointError: the file's size differs from the manifest's (is short of it, ``at_least``).
    """

    def __init__(self, path: Path, fe: FileEntry, *, at_least: bool = False) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(self._fd).st_size
            if size < fe.size or (size != fe.size and not at_least):
                raise CorruptCheckpointError(f"{path} has {os.fstat(self._fd).st_size} bytes; the manifest says {fe.size}")
        except BaseException:
            os.close(self._fd)
            raise

    def __enter__(self) -> ShardFile:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)

    def head(self, n: int) -> bytes:
        """The first ``n`` bytes of the file."""
        return os.pread(self._fd, n, 0)

    def fill(self, blocks: list[tuple[list[memoryview], int, int | None, int]]) -> None:
        """Read a run of checksum blocks, each ``(views in file order, file offset, expected crc32c or None,
        block index)``, verifying those that carry a checksum."""
        for views, offset, expected, index in blocks:
            _read_chunk(self._fd, self.path, views, offset, expected, index)


def read_blocks(path: Path, fe: FileEntry, first: int, views: list[memoryview], *, verify: bool) -> None:
    """Fill ``views`` (in file order, whole checksum blocks from block ``first`` on) from the local shard
    file ``path`` with ``preadv``, straight into them, and verify them (unless ``verify`` is off).

    Raises:
        CorruptCheckpointError: the file is missing or short, or a block does not match its checksum.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path} is missing") from None
    try:
        _read_exact(fd, views, first * fe.chunk_bytes, path)
    finally:
        os.close(fd)
    if verify:
        fe.check_views(views, first, where=str(path))


class LocalTier:
    """The :class:`~persist_core.tiers.tier.Tier` of a local directory (nothing here writes but ``remove``); a
    :class:`~persist_core.tiers.tier.HostReader` too."""

    kind = "local"

    def __init__(self, root: Path) -> None:
        self.root = root
        self._depends: dict[int, tuple[int, set[int]]] = {}  # step -> (its manifest's mtime_ns, depends_on())

    @property
    def location(self) -> str:
        return str(self.root)

    def __repr__(self) -> str:
        return f"LocalTier({str(self.root)!r})"

    def committed_steps(self) -> list[int]:
        return committed_steps(self.root)

    def read_blocks(self, step: int, f: FileEntry, first: int, views: list[memoryview], *, verify: bool = True) -> None:
        """Fill ``views`` with whole checksum blocks of ``f`` of ``step`` from block ``first`` on (as
        :func:`read_blocks`; the remote tier's method of the same name reads by ranged requests)."""
        read_blocks(checkpoint_dir(self.root, step) / f.name, f, first, views, verify=verify)

    def read_manifest(self, step: int) -> Manifest:
        return read_manifest(checkpoint_dir(self.root, step))

    def open_file(self, step: int, f: FileEntry) -> ShardFile:
        """File ``f`` of ``step`` open for a whole read (:class:`ShardFile`: its size is the manifest's)."""
        return ShardFile(checkpoint_dir(self.root, step) / f.name, f)

    def copies(self, step: int) -> list[LocalTier]:
        """A directory holds one copy of a step: itself."""
        return [self]

    def depends_on(self, step: int) -> set[int]:
        """The checkpoints committed checkpoint ``step`` references (incremental saves); nothing for one that does
        not read (it is no checkpoint to keep). Cached while its manifest is the same file."""
        path = checkpoint_dir(self.root, step) / MANIFEST_NAME
        try:
            mtime = os.stat(path).st_mtime_ns
            cached = self._depends.get(step)
            if cached is None or cached[0] != mtime:
                cached = self._depends[step] = (mtime, read_manifest(path.parent).depends_on())
            return set(cached[1])
        except (OSError, CorruptCheckpointError, CheckpointNotFoundError):
            return set()

    def listing(self) -> list[tuple[CheckpointInfo, Manifest]]:
        """Committed checkpoints whose manifest and file sizes check, with their manifests, oldest first."""
        return discover(self.root)

    def list(self) -> list[CheckpointInfo]:
        return [info for info, _ in discover(self.root)]

    def verify(self, step: int, progress: Callable[[int], None] | None = None) -> list[str]:
        ckpt = checkpoint_dir(self.root, step)
        return verify_files(ckpt, read_manifest(ckpt), progress)

    def remove(self, step: int) -> None:
        discard(self.root, checkpoint_dir(self.root, step))

    def set_aside(self, step: int, at: int) -> None:
        """Move checkpoint ``step`` out of the live branch (one durable rename): a run resumed from ``at``."""
        if is_link(checkpoint_dir(self.root, step)):  # not ours: never renamed
            return
        os.rename(checkpoint_dir(self.root, step), self.root / abandoned_dirname(step, at, secrets.token_hex(3)))
        fsync_dir(self.root)
        log.info("[step=%d] set aside in %s: the run resumed from step %d and saved past it", step, self.root, at)

    def abandoned_referenced(self) -> set[int]:
        """The live checkpoints that the set-aside ones reference (incremental saves): kept while they are."""
        return {dep for _, _, m, _ in self.abandoned_manifests() for dep in m.depends_on()}

    def remove_abandoned(self, path: str) -> None:
        """Remove the set-aside checkpoint at ``path`` (one that :meth:`abandoned` listed; ``persist gc --abandoned``):
        one durable rename out of the directory first, as :meth:`remove` does."""
        ckpt = Path(path)
        if ckpt.parent != self.root or parse_abandoned_dirname(ckpt.name) is None:
            raise ValueError(f"{path} is not a set-aside checkpoint of {self.root} (abandoned-step-N-at-M-...)")
        discard(self.root, ckpt)

    def abandoned(self) -> list[CheckpointInfo]:
        """Checkpoints set aside when a run resumed from an older one, oldest first (kept until
        ``persist gc --abandoned``; never pruned by retention)."""
        return [CheckpointInfo(step=step, time=m.time, nbytes=m.nbytes, path=path)
                for step, _, m, path in self.abandoned_manifests()]

    def abandoned_manifests(self) -> list[tuple[int, int, Manifest, str]]:
        """``(step, resumed-at step, manifest, path)`` of each set-aside checkpoint that reads, oldest first."""
        found = []
        for entry in os.scandir(self.root):
            parsed = parse_abandoned_dirname(entry.name)
            if parsed is None or is_link(entry.path):
                continue
            try:
                m = Manifest.from_bytes((Path(entry.path) / MANIFEST_NAME).read_bytes(), where=entry.path, step=parsed[0])
            except (OSError, CorruptCheckpointError) as e:
                log.warning("skipping %s: %s", entry.path, e)
                continue
            found.append((parsed[0], parsed[1], m, entry.path))
        return sorted(found, key=lambda f: (f[0], f[3]))


def open_local_dir(root: Path, *, rank: int) -> DirLock:
    """Create ``root``, check it takes files, take this rank's writer lock, remove dead temporaries.

    No collective here: adapters open their engines at different moments on different ranks.

    Raises:
        ConfigError: ``root`` cannot be created or written.
        DirectoryInUseError: another live writer holds the lock of this rank (named, with its holder).
    """
    _check_writable(root)
    lock = take(root, rank)
    remove_dead(root, rank=rank)
    return lock


def _check_writable(root: Path) -> None:
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".probe-pid{os.getpid()}-{secrets.token_hex(3)}"
        os.close(open_side_file(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"local_dir={str(root)!r} is not a writable directory ({e.strerror or e}); "
            "pass a directory this process can create files in"
        ) from e
