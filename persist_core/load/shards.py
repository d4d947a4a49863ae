"""Reading shard files and rebuilding the state from them, wherever the files are.

:func:`read_shard` reads one file into one byte tensor per entry through a ``fill`` (local ``preadv``,
or the remote's ranged reads), every checksum block verified; :func:`load_checkpoint` rebuilds the saved
state from a checkpoint's files (sharded tensors whole, pickled leaves by restricted unpickling);
:func:`read_blocks` fills given memory from a local file for a resharding load.
"""

from __future__ import annotations

import ctypes
import math
import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import crc32c
import torch

from persist_core import _knobs
from persist_core.errors import CorruptCheckpointError
from persist_core.format import unpickle
from persist_core.format.manifest import FileEntry, Manifest
from persist_core.format.shard_file import (OBJECTS_ENTRY, PER_RANK_ENTRY, dtype_from_name, entry_dtypes, itemsize,
                                            parse_header, whole_entry_mismatch)
from persist_core.format.torch_zip import image_offset
from persist_core.format.tree import unflatten
from persist_core.load.assemble import LoadOptions, assemble, per_rank_values

_IOV_BATCH = 512


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
