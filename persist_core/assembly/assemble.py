"""Shard bytes -> the state: the last phase of a load.

:func:`load_into` fills targets in place — plain tensors, or ``DTensor`` s on any mesh (a job resumed on
another number of ranks or another layout): for each target it asks :mod:`~persist_core.assembly.plan` which
byte ranges of the saved chunks the part this rank holds overlaps, requests exactly those of a
:class:`~persist_core.assembly.blocks.ReadPlan` (whole checksum blocks, each verified, runs in parallel) and
copies them into place; tensors without a target are read whole. :func:`iter_tensors` gives each tensor
whole, one at a time (consolidation). :func:`load_checkpoint` rebuilds the state from shard files read
whole (local, or streamed from the remote); :func:`read_copy` reads a copy of files on this host (a local directory,
a memory slot) by one of the two; :func:`assemble` builds a sharded tensor whole from its chunks.

Who calls what: :class:`~persist_core.load.reader.CheckpointReader` calls :func:`load_into` with a
``read_blocks`` for the tier the checkpoint is on (local ``pread`` or remote ranged reads) and
:func:`load_checkpoint`; :class:`~persist_core.load.remote.RemoteRestore` calls :func:`load_checkpoint` with
the remote's reads; :mod:`~persist_core.load.consolidate` calls :func:`iter_tensors`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Container, Iterator
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import torch

from persist_core import hostmem
from persist_core.errors import ConfigError, CorruptCheckpointError
from persist_core.format import unpickle
from persist_core.format.manifest import FileEntry, Manifest
from persist_core.format.records import Chunk, TensorRecord
from persist_core.format.shard_file import (OBJECTS_ENTRY, PER_RANK_ENTRY, dtype_from_name, itemsize,
                                            whole_entry_mismatch)
from persist_core.format.tree import flatten, tensor_paths, unflatten
from persist_core.assembly.blocks import LoadStats, ReadBlocks, ReadPlan, bytes_of, read_shard
from persist_core.assembly.plan import LoadOptions, chunk_read, saved_chunks, slices, target_box
from persist_core.tiers.local import ShardFile
from persist_core.tiers.tier import HostReader

log = logging.getLogger(__name__)


def assemble(rec: TensorRecord, entry_of: Callable[[Chunk], torch.Tensor], device: torch.device) -> torch.Tensor:
    """The whole tensor of a sharded record from the byte tensor of each chunk's entry."""
    dtype = dtype_from_name(rec.dtype)
    if sum(math.prod(c.sizes) for c in rec.chunks or ()) != math.prod(rec.shape):  # a rank's part (a snapshot)
        raise CorruptCheckpointError(f"a sharded tensor of shape {list(rec.shape)} is not whole here (a rank's memory "
                                     "snapshot holds its own part: load it into sharded targets)")
    full = torch.empty(rec.shape, dtype=dtype, device=device)
    for c in rec.chunks or ():
        sizes = c.sizes
        if math.prod(sizes) == 0:
            continue
        raw = entry_of(c)
        part = (raw.view(dtype) if dtype != torch.uint8 else raw).view(sizes)
        full[slices((c.offsets, sizes), (0,) * len(sizes))].copy_(part)
    return full


def per_rank_values(manifest: Manifest, rank: int, value_bytes: Callable[[str, int, int], Any], *,
                    where: str, weights_only: bool = True) -> list[Any] | None:
    """The ``PerRank`` values rank ``rank`` saved, or ``None`` (with a warning) when no such rank saved.

    ``value_bytes(file, begin, length)``: the pickled bytes of one, from its file's ``__per_rank__`` entry.
    """
    if not manifest.per_rank:
        return None
    if rank >= len(manifest.per_rank):
        log.warning("%s was saved by %d ranks: rank %d has no PerRank values of its own and gets None for them",
                    where, len(manifest.per_rank), rank)
        return None
    values = []
    for fname, begin, length in manifest.per_rank[rank]:
        try:
            raw = value_bytes(fname, begin, length)
        except Exception as e:  # a manifest that names the wrong place, however looking it up fails
            raise CorruptCheckpointError(f"{where}: a PerRank value of rank {rank} is not where the manifest says ({e})"
                                         ) from e
        values.append(unpickle.loads(raw, weights_only=weights_only, where=f"{where} (rank {rank}'s PerRank value)"))
    return values


def _direct(dst: torch.Tensor, dtype: torch.dtype, span_is_box: bool) -> bool:
    """Whether the saved bytes can be read straight into ``dst``: same dtype, host memory, both sides one
    contiguous run of the same elements in the same order."""
    return span_is_box and dst.dtype == dtype and dst.device.type == "cpu" and dst.is_contiguous() and dst.numel() > 0


def iter_tensors(manifest: Manifest, *, read_blocks: ReadBlocks, pool: Executor, where: str,
                 stats: LoadStats | None = None, only: Container[str] | None = None
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of the checkpoint whole (sharded ones assembled), one at a time, with its key path:
    memory about the largest tensor, not the state (consolidation, ``persist export``). ``only``: the key paths
    to read (the others are not read)."""
    stats = stats if stats is not None else LoadStats()
    headers: dict[str, tuple[dict[str, tuple[int, int]], dict[str, str]]] = {}
    paths = tensor_paths(manifest.tree)
    if len(paths) != len(manifest.tensors):
        raise CorruptCheckpointError(f"{where}: the manifest's tree has {len(paths)} tensors, its records "
                                     f"{len(manifest.tensors)}")
    for path, rec in zip(paths, manifest.tensors):
        if only is not None and path not in only:
            continue
        plan = ReadPlan(manifest, read_blocks, pool, stats, headers)
        tensor = _plan_tensor(plan, path, rec, None, torch.device("cpu"), where)
        plan.run()
        yield path, tensor


def load_into(manifest: Manifest, into: Any, *, read_blocks: ReadBlocks, pool: Executor,
              options: LoadOptions = LoadOptions(), where: str, stats: LoadStats | None = None) -> Any:
    """The state of ``manifest`` with each tensor that ``into`` has at the same key path filled in place.

    Args:
        manifest: the checkpoint's manifest.
        into: a state shaped like the saved one (``{"model": msd, "optim": osd}`` from
            ``get_state_dict``): its tensors and ``DTensor`` s are the targets; each must have the
            saved global shape. Other saved tensors are read whole (onto ``map_location``).
        read_blocks: reads verified checksum blocks of one of the checkpoint's files.
        pool: threads for the reads.
        options: the device for tensors read whole, whose ``PerRank`` values, how to unpickle.
        where: the checkpoint's name, for messages.
        stats: filled with the bytes needed and read.

    Returns:
        The saved state, its tensors being the targets where ``into`` had one.

    Raises:
        ConfigError: a target's shape differs from the saved one, or ``into`` has a tensor the
            checkpoint lacks (both named by key path).
        CorruptCheckpointError: a block does not verify, or the manifest does not fit its files.
    """
    stats = stats if stats is not None else LoadStats()
    rank = options.rank
    device = torch.device("cpu") if options.map_location is None else torch.device(options.map_location)
    targets = dict(flatten(into).tensors)
    objects_raw: list[bytes | None] = [None] * len(manifest.objects)
    plan = ReadPlan(manifest, read_blocks, pool, stats)

    def keep(store: list[bytes | None], k: int) -> Callable[[memoryview], None]:
        def done(mv: memoryview) -> None:
            store[k] = bytes(mv)
        return done

    for k, (fname, begin, length) in enumerate(manifest.objects):
        b, _ = plan.entry(fname, OBJECTS_ENTRY)
        plan.request(fname, b + begin, b + begin + length, keep(objects_raw, k))
    mine = manifest.per_rank[rank] if rank < len(manifest.per_rank) else ()
    per_rank_raw: list[bytes | None] = [None] * len(mine)
    for k, (fname, begin, length) in enumerate(mine):
        b, _ = plan.entry(fname, PER_RANK_ENTRY)
        plan.request(fname, b + begin, b + begin + length, keep(per_rank_raw, k))

    try:
        key_objects = None if not any("object" in k for k in _dict_keys(manifest.tree)) else _objects_now(
            plan, manifest, options.weights_only, where)
        paths = tensor_paths(manifest.tree, key_objects)
    except CorruptCheckpointError:
        raise
    except Exception as e:  # a damaged tree, however it fails
        raise CorruptCheckpointError(f"{where}: the manifest's tree does not parse ({type(e).__name__}: {e})") from e
    if len(paths) != len(manifest.tensors):
        raise CorruptCheckpointError(f"{where}: the manifest's tree has {len(paths)} tensors, its records "
                                     f"{len(manifest.tensors)}")
    extra = sorted(set(targets) - set(paths))
    if extra:
        raise ConfigError(f"into= has tensors {extra[:5]} that {where} does not hold (it holds {paths[:5]}...): "
                          "pass targets at the saved key paths")
    tensors: list[torch.Tensor] = []
    for path, rec in zip(paths, manifest.tensors):
        tensors.append(_plan_tensor(plan, path, rec, targets.get(path), device, where))
    plan.run()
    objects = [unpickle.loads(raw or b"", weights_only=options.weights_only, where=where) for raw in objects_raw]
    ordered = iter(per_rank_raw)
    per_rank = per_rank_values(manifest, rank, lambda f, b, n: next(ordered), where=where,
                               weights_only=options.weights_only)
    try:
        return unflatten(manifest.tree, tensors, objects, per_rank)
    except Exception as e:  # a tree that does not fit its records, however it fails
        raise CorruptCheckpointError(f"{where}: the manifest's tree does not match its tensors ({e})") from e


def _dict_keys(tree: Any) -> list[Any]:
    keys: list[Any] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.get("dict", ()):
                keys.append(k)
                walk(v)
            for v in node.get("list", node.get("tuple", ())):
                walk(v)

    walk(tree)
    return keys


def _objects_now(plan: ReadPlan, manifest: Manifest, weights_only: bool, where: str) -> list[Any]:
    """The pickled leaves read at once (a dict key that was pickled is part of a tensor's path)."""
    out = []
    for fname, begin, length in manifest.objects:
        b, _ = plan.entry(fname, OBJECTS_ENTRY)
        raw = plan._read_range(plan._file(fname), b + begin, b + begin + length)
        out.append(unpickle.loads(raw, weights_only=weights_only, where=where))
    return out


def _plan_tensor(plan: ReadPlan, path: str, rec: TensorRecord, target: torch.Tensor | None, device: torch.device,
                 where: str) -> torch.Tensor:
    """Request the bytes ``target`` (or, without one, the whole saved tensor) needs; returns what the
    state will hold there."""
    try:
        dtype = dtype_from_name(rec.dtype)
        shape = rec.shape
        chunks = saved_chunks(rec)
    except CorruptCheckpointError:
        raise
    except Exception as e:  # a damaged record, however it fails
        raise CorruptCheckpointError(f"{where}: the record of {path!r} is damaged ({e})") from e
    for c in chunks:  # the record agrees with its shard's header before anything is compared or read
        if c.stride is None:
            plan.check_whole(c.file, c.entry, dtype, math.prod(c.sizes), where)
    if target is None:
        result = torch.empty(shape, dtype=dtype, device=device)
        dest, box = result, ((0,) * len(shape), shape)
    else:
        dest, box, global_shape = target_box(target)
        if global_shape != shape:
            raise ConfigError(f"into[{path!r}] has shape {list(global_shape)} but {where} saved {list(shape)}: pass a "
                              "target of the saved (global) shape")
        result = target
    if box is None or math.prod(box[1]) == 0:
        return result
    es = itemsize(dtype)
    reads = [(c, chunk_read(box, c, len(shape), es, path, where)) for c in chunks]
    if sum(math.prod(r.meet[1]) for _, r in reads if r is not None) != math.prod(box[1]):  # the chunks do not overlap
        raise CorruptCheckpointError(f"{where} does not hold all of {path!r} that "
                                     + ("a whole load" if target is None else "the target's part")
                                     + " needs (a rank's memory snapshot holds its own part of a sharded tensor)")
    for c, r in reads:
        if r is None:
            continue
        begin, entry_end = plan.entry(c.file, c.entry)
        dst = dest[slices(r.meet, box[0])]
        start, stop = begin + r.start, begin + r.stop
        if stop > entry_end or start < begin + r.low:
            raise CorruptCheckpointError(f"{where}: the record of {path!r} reaches past its entry {c.entry!r}")
        if _direct(dst, dtype, r.in_order):  # the bytes are the target's, in order
            plan.request(c.file, start, stop, into=bytes_of(dst))
            continue

        def done(mv: memoryview, dst: torch.Tensor = dst, sizes: tuple[int, ...] = r.meet[1],
                 strides: tuple[int, ...] = r.strides) -> None:
            flat = torch.frombuffer(bytearray(mv) if mv.readonly else mv, dtype=torch.uint8)
            src = (flat.view(dtype) if dtype != torch.uint8 else flat).as_strided(sizes, strides)
            with torch.no_grad():
                hostmem.copy_here(dst, src)  # on a read thread: no second OpenMP team to slow training after

        plan.request(c.file, start, stop, done)
    return result


def _check_entry(rec: TensorRecord, header_dtype: str | None, nbytes: int, dtype: torch.dtype) -> None:
    """A record agrees with the shard entry that holds it: a whole-entry tensor has the entry's dtype and
    exactly its bytes; a view into a shared entry stays inside it.

    Raises:
        RuntimeError: they disagree (the caller makes it a CorruptCheckpointError naming the record).
    """
    es = itemsize(dtype)
    shape = rec.shape
    if rec.stride is None:
        problem = whole_entry_mismatch(header_dtype, nbytes, dtype, math.prod(shape))
        if problem is not None:
            raise RuntimeError(problem)
        return
    if math.prod(shape) == 0:
        return
    last = rec.offset // es + sum((n - 1) * st for n, st in zip(shape, rec.stride))
    if (last + 1) * es > nbytes:
        raise RuntimeError(f"the view ends at byte {(last + 1) * es}, past its shared entry's {nbytes}")


def _read_shard(path: Path, fe: FileEntry, *, pool: Executor,
                verify: bool) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read one local shard file into one CPU byte tensor per entry, verifying chunk checksums; and the
    safetensors dtype its header gives each entry."""
    with ShardFile(path, fe) as file:
        return read_shard(fe, head=file.head, fill=file.fill, pool=pool, verify=verify, where=str(path))


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
            blob = bytes_of(entries[fname][OBJECTS_ENTRY])[begin : begin + length]
        except KeyError as e:
            raise CorruptCheckpointError(f"{ckpt}: the manifest places a pickled leaf in {e}, which it lacks") from e
        objects.append(unpickle.loads(blob, weights_only=options.weights_only, where=str(ckpt)))
    per_rank = per_rank_values(manifest, options.rank, lambda f, b, n: bytes_of(entries[f][PER_RANK_ENTRY])[b : b + n],
                               where=str(ckpt), weights_only=options.weights_only)
    if device.type != "cpu":
        entries = {f: {n: t.to(device) for n, t in es.items() if n not in (OBJECTS_ENTRY, PER_RANK_ENTRY)}
                   for f, es in entries.items()}
    tensors = []
    for rec in manifest.tensors:
        try:
            if rec.sharded:  # the whole tensor from every rank's part
                tensors.append(assemble(rec, lambda c: entries[c.file][c.entry], device))
                continue
            entry = entries[rec.file][rec.entry]
            dtype = dtype_from_name(rec.dtype)
            shape = rec.shape
            _check_entry(rec, header_dtypes[rec.file].get(rec.entry), entry.numel(), dtype)
            if rec.stride is None:
                t = (entry.view(dtype) if dtype != torch.uint8 else entry).view(shape)
            else:
                es = itemsize(dtype)
                if rec.offset % es:
                    raise RuntimeError(f"offset {rec.offset} is not a multiple of {es}")
                t = torch.empty(0, dtype=dtype, device=entry.device).set_(
                    entry.untyped_storage(), rec.offset // es, shape, rec.stride
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


def read_copy(copy: HostReader, step: int, manifest: Manifest, into: Any, *, options: LoadOptions, pool: Executor,
              stats: LoadStats, where: str) -> Any:
    """The state of ``step`` from ``copy`` (files on this host: a local directory, a memory slot), every byte
    verified: ``into`` filled in place by ``copy.read_blocks``, or each file read whole (``copy.open_file``) as
    :func:`load_checkpoint` reads it, so tensors that shared storage when saved share it again (tied weights, views).
    A memory copy (``kind`` ``"memory"``) is its rank's own one-rank image: its ``PerRank`` values are the ones it
    holds, whatever the reading process's rank.

    Raises:
        CorruptCheckpointError: a byte does not verify, or a file is shorter than ``manifest`` says.
    """
    if copy.kind == "memory":
        options = dataclasses.replace(options, rank=0)
    if into is not None:
        return load_into(manifest, into, pool=pool, options=options, where=where, stats=stats,
                         read_blocks=lambda f, first, views: copy.read_blocks(step, f, first, views,
                                                                            verify=options.verify))

    def shard(fe: FileEntry) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        with copy.open_file(step, fe) as file:
            return read_shard(fe, head=file.head, fill=file.fill, pool=pool, verify=options.verify,
                              where=str(file.path))

    state = load_checkpoint(where, manifest, pool=pool, options=options, shard=shard)
    stats.needed_bytes = stats.read_bytes = sum(f.size for f in manifest.files)
    return state
