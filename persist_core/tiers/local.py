"""The local tier: committed checkpoint directories under ``local_dir``, and verified loading.

Readers never trust a manifest alone: :func:`check_files` checks that every file it names is
there with its size, and :func:`load_checkpoint` verifies every chunk's crc32c while reading
(unless ``verify=False``), straight into the memory of the returned tensors.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import secrets
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import crc32c
import torch

from persist_core import _knobs
from persist_core.errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError
from persist_core.format.shard_file import (OBJECTS_ENTRY, PER_RANK_ENTRY, dtype_from_name, entry_dtypes, itemsize,
                                            parse_header, whole_entry_mismatch)
from persist_core.format.torch_zip import image_offset
from persist_core.format.tree import unflatten
from persist_core.fileio import fsync_dir
from persist_core.layout import (
    MANIFEST_NAME,
    abandoned_dirname,
    checkpoint_dirname,
    parse_abandoned_dirname,
    parse_checkpoint_dirname,
)
from persist_core.ownership import DirLock, discard, remove_dead, take
from persist_core.format.manifest import FileEntry, Manifest
from persist_core.format import unpickle
from persist_core.planning.load import LoadOptions, assemble, per_rank_values
from persist_core.tiers.tier import CheckpointInfo

log = logging.getLogger(__name__)

_IOV_BATCH = 512


def checkpoint_dir(root: Path, step: int) -> Path:
    return root / checkpoint_dirname(step)


def committed_steps(root: Path) -> list[int]:
    """Steps of the directories under ``root`` that hold a manifest, ascending (nothing verified)."""
    steps = []
    for entry in os.scandir(root):
        step = parse_checkpoint_dirname(entry.name)
        if step is not None and os.path.exists(os.path.join(entry.path, MANIFEST_NAME)):
            steps.append(step)
    return sorted(steps)


def read_manifest(ckpt: Path) -> Manifest:
    """The manifest of the checkpoint directory ``ckpt``, with its files checked.

    Raises:
        CheckpointNotFoundError: no manifest.
        CorruptCheckpointError: unreadable manifest, or a file missing or of the wrong size.
    """
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

    Ones that do not check are logged at WARNING and left out.
    """
    found = []
    for step in committed_steps(root):
        ckpt = checkpoint_dir(root, step)
        try:
            manifest = read_manifest(ckpt)
        except CorruptCheckpointError as e:
            log.warning("skipping %s: %s", ckpt, e)
            continue
        found.append((CheckpointInfo(step=step, time=manifest.time, nbytes=manifest.nbytes, path=str(ckpt)), manifest))
    return found


def _view(t: torch.Tensor) -> memoryview:
    return memoryview((ctypes.c_char * t.numel()).from_address(t.data_ptr())).cast("B")


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


def _read_chunks(fd: int, path: Path, blocks: list[tuple[list[memoryview], int, int | None, int]]) -> None:
    for views, offset, expected, index in blocks:
        _read_chunk(fd, path, views, offset, expected, index)


#: ``fill(blocks)``: read and (where they carry a checksum) verify a run of consecutive checksum blocks,
#: each ``(views in file order, file offset, expected crc32c or None, block index)``
Fill = Callable[[list[tuple[list[memoryview], int, int | None, int]]], None]


def _read_shard(path: Path, fe: FileEntry, *, pool: Executor,
                verify: bool) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read one local shard file into one CPU byte tensor per entry, verifying chunk checksums; and the
    safetensors dtype its header gives each entry."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_size != fe.size:
            raise CorruptCheckpointError(f"{path} has {os.fstat(fd).st_size} bytes; the manifest says {fe.size}")
        return read_shard(fe, head=lambda n: os.pread(fd, n, 0), fill=lambda blocks: _read_chunks(fd, path, blocks),
                          pool=pool, verify=verify, where=str(path))
    finally:
        os.close(fd)


def read_shard(fe: FileEntry, *, head: Callable[[int], bytes], fill: Fill, pool: Executor, verify: bool,
               where: str, span_bytes: int | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """One shard file, wherever it is, into one CPU byte tensor per entry, every checksum block verified;
    and the safetensors dtype its header gives each entry.

    Args:
        fe: the file's manifest entry.
        head: the first ``n`` bytes of the file (its header).
        fill: reads runs of blocks straight into the entries' memory (local ``preadv``, remote ranged reads).
        pool: threads; runs of about one write's worth of blocks are read in parallel.
        verify: check every block's crc32c.
        where: the file's name, for messages.
        span_bytes: about how many bytes one ``fill`` call reads (default: one write's worth).
    """
    prefix = head(1 << 16)
    skip = image_offset(prefix)  # past the zip local header of a torch-loadable shard
    if len(prefix) >= skip + 8 and skip + 8 + int.from_bytes(prefix[skip : skip + 8], "little") > len(prefix):
        prefix = head(min(fe.size, skip + 8 + int.from_bytes(prefix[skip : skip + 8], "little")))
    try:
        data_start, entries = parse_header(prefix, file_size=fe.size)
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"{where}: {e}") from e
    header_copy = bytearray(data_start)
    # regions in file order: (file offset, memoryview to fill)
    regions: list[tuple[int, memoryview]] = [(0, memoryview(header_copy))]
    tensors: dict[str, torch.Tensor] = {}
    for name, begin, end in entries:
        if name.startswith("__pad__"):
            regions.append((begin, memoryview(bytearray(end - begin))))
        else:
            t = tensors[name] = torch.empty(end - begin, dtype=torch.uint8)
            if end > begin:
                regions.append((begin, _view(t)))

    chunk = fe.chunk_bytes
    n_chunks = -(-fe.size // chunk)
    if verify and len(fe.chunks) != n_chunks:
        raise CorruptCheckpointError(f"{where}: manifest lists {len(fe.chunks)} checksums for {n_chunks} chunks")
    blocks = []
    r = 0
    for i in range(n_chunks):
        lo, hi = i * chunk, min((i + 1) * chunk, fe.size)
        views = []
        while r < len(regions) and regions[r][0] < hi:
            off, mv = regions[r]
            a, b = max(lo, off) - off, min(hi, off + len(mv)) - off
            views.append(mv[a:b])
            if off + len(mv) <= hi:
                r += 1
            else:
                break
        blocks.append((views, lo, fe.chunks[i] if verify else None, i))
    per = max(1, (span_bytes or _knobs.chunk_bytes()) // chunk)  # one job: about one write's worth of blocks
    jobs = [pool.submit(fill, blocks[b : b + per]) for b in range(0, len(blocks), per)]
    errors = [j.exception() for j in jobs]
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    if bytes(header_copy) != prefix[:data_start]:
        raise CorruptCheckpointError(f"{where}: header changed while reading")
    return tensors, entry_dtypes(prefix)


def _check_entry(rec: dict[str, Any], header_dtype: str | None, nbytes: int, dtype: torch.dtype) -> None:
    """A record agrees with the shard entry that holds it: a whole-entry tensor has the entry's dtype and
    exactly its bytes; a view into a shared entry stays inside it.

    Raises:
        RuntimeError: they disagree (the caller makes it a CorruptCheckpointError naming the record).
    """
    es = itemsize(dtype)
    shape = rec["shape"]
    if rec["stride"] is None:
        problem = whole_entry_mismatch(header_dtype, nbytes, dtype, math.prod(shape))
        if problem is not None:
            raise RuntimeError(problem)
        return
    if math.prod(shape) == 0:
        return
    last = rec["offset"] // es + sum((n - 1) * st for n, st in zip(shape, rec["stride"]))
    if (last + 1) * es > nbytes:
        raise RuntimeError(f"the view ends at byte {(last + 1) * es}, past its shared entry's {nbytes}")


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


def load_checkpoint(ckpt: Path | str, manifest: Manifest, *, pool: Executor, options: LoadOptions,
                    shard: Callable[[FileEntry], tuple[dict[str, torch.Tensor], dict[str, str]]] | None = None) -> Any:
    """Load and rebuild the state of the checkpoint directory ``ckpt``: sharded tensors whole.

    Args:
        ckpt: the committed checkpoint directory (or, with ``shard``, its name for messages).
        manifest: its manifest (from :func:`read_manifest`).
        pool: threads for parallel chunk reads.
        options: verify checksums, the device for the tensors, whose ``PerRank`` values, how to unpickle.
        shard: reads one file into its entries (:func:`read_shard`); default: from ``ckpt``.

    Raises:
        CorruptCheckpointError: a file or checksum does not verify (the message names the file).
        UnsafeCheckpointError: a leaf names a type restricted unpickling does not load.
    """
    device = torch.device("cpu") if options.map_location is None else torch.device(options.map_location)
    if shard is None:
        def shard(f: FileEntry) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
            return _read_shard(Path(ckpt) / f.name, f, pool=pool, verify=options.verify)
    shards = {f.name: shard(f) for f in manifest.files}
    entries = {name: tensors for name, (tensors, _) in shards.items()}
    header_dtypes = {name: dtypes for name, (_, dtypes) in shards.items()}
    objects = []
    for fname, begin, length in manifest.objects:
        try:
            blob = _view(entries[fname][OBJECTS_ENTRY])[begin : begin + length]
        except KeyError as e:
            raise CorruptCheckpointError(f"{ckpt}: the manifest places a pickled leaf in {e}, which it lacks") from e
        objects.append(unpickle.loads(blob, weights_only=options.weights_only, where=str(ckpt)))
    per_rank = per_rank_values(manifest, options.rank, lambda f, b, n: _view(entries[f][PER_RANK_ENTRY])[b : b + n],
                               where=str(ckpt), weights_only=options.weights_only)
    if device.type != "cpu":
        entries = {f: {n: t.to(device) for n, t in es.items() if n not in (OBJECTS_ENTRY, PER_RANK_ENTRY)}
                   for f, es in entries.items()}
    tensors = []
    for rec in manifest.tensors:
        try:
            if "chunks" in rec:  # sharded: the whole tensor from every rank's part
                tensors.append(assemble(rec, lambda c: entries[c["file"]][c["entry"]], device))
                continue
            entry = entries[rec["file"]][rec["entry"]]
            dtype = dtype_from_name(rec["dtype"])
            shape = tuple(rec["shape"])
            _check_entry(rec, header_dtypes[rec["file"]].get(rec["entry"]), entry.numel(), dtype)
            if rec["stride"] is None:
                t = (entry.view(dtype) if dtype != torch.uint8 else entry).view(shape)
            else:
                es = itemsize(dtype)
                if rec["offset"] % es:
                    raise RuntimeError(f"offset {rec['offset']} is not a multiple of {es}")
                t = torch.empty(0, dtype=dtype, device=entry.device).set_(
                    entry.untyped_storage(), rec["offset"] // es, shape, tuple(rec["stride"])
                )
        except Exception as e:  # any failure to rebuild from a record means the record is damaged
            raise CorruptCheckpointError(f"{ckpt}: tensor record {rec} does not match its shard: {e}") from e
        tensors.append(t)
    try:
        return unflatten(manifest.tree, tensors, objects, per_rank)
    except CorruptCheckpointError:
        raise
    except Exception as e:  # a tree that does not fit the records, however it fails
        raise CorruptCheckpointError(f"{ckpt}: the manifest's tree does not match its tensors ({type(e).__name__}: "
                                     f"{e})") from e


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


class LocalTier:
    """The :class:`~persist_core.tiers.tier.Tier` of a local directory (nothing here writes but ``remove``)."""

    kind = "local"

    def __init__(self, root: Path) -> None:
        self.root = root

    @property
    def location(self) -> str:
        return str(self.root)

    def __repr__(self) -> str:
        return f"LocalTier({str(self.root)!r})"

    def committed_steps(self) -> list[int]:
        return committed_steps(self.root)

    def read_manifest(self, step: int) -> Manifest:
        return read_manifest(checkpoint_dir(self.root, step))

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
        os.rename(checkpoint_dir(self.root, step), self.root / abandoned_dirname(step, at, secrets.token_hex(3)))
        fsync_dir(self.root)
        log.info("[step=%d] set aside in %s: the run resumed from step %d and saved past it", step, self.root, at)

    def abandoned(self) -> list[CheckpointInfo]:
        """Checkpoints set aside when a run resumed from an older one, oldest first (kept, never pruned)."""
        return [CheckpointInfo(step=step, time=m.time, nbytes=m.nbytes, path=path)
                for step, _, m, path in self.abandoned_manifests()]

    def abandoned_manifests(self) -> list[tuple[int, int, Manifest, str]]:
        """``(step, resumed-at step, manifest, path)`` of each set-aside checkpoint that reads, oldest first."""
        found = []
        for entry in os.scandir(self.root):
            parsed = parse_abandoned_dirname(entry.name)
            if parsed is None:
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
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"local_dir={str(root)!r} is not a writable directory ({e.strerror or e}); "
            "pass a directory this process can create files in"
        ) from e
