"""Following an incremental checkpoint's references (format version 6, issue 43): its records that name bytes held
by an older checkpoint's file are read from that file, every byte verified by that file's checksums, each once.

:func:`resolve` turns a manifest with references into one whose records all name files of its ``files`` list: each
referenced file appears under the name ``step-N/rank-R.safetensors`` (relative to ``local_dir``) with the
referenced manifest's :class:`~persist_core.format.manifest.FileEntry` (its size and block checksums), so the read
plans (:mod:`~persist_core.assembly.blocks`) and the assembly (:mod:`~persist_core.assembly.assemble`) work unchanged.
:func:`read_referenced` reads the referenced entries for a whole load (the own files are read whole as always).

Who calls what: :class:`~persist_core.load.reader.CheckpointReader` calls :func:`load_referencing` for a local
checkpoint whose manifest depends on others (:func:`resolve`, then :func:`~persist_core.assembly.assemble.load_into` into
targets, or :func:`read_referenced` and :func:`~persist_core.assembly.assemble.load_checkpoint` whole);
:mod:`~persist_core.load.consolidate` calls :func:`resolve` and :func:`split_name` (any tier).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import torch

from persist_core.errors import CheckpointNotFoundError, CorruptCheckpointError, RemoteError
from persist_core.format.manifest import FileEntry, Manifest
from persist_core.format.records import Chunk
from persist_core.layout import checkpoint_dirname
from persist_core.assembly.assemble import _read_shard, load_checkpoint, load_into
from persist_core.assembly.blocks import LoadStats, ReadBlocks, ReadPlan, bytes_of
from persist_core.assembly.plan import LoadOptions
from persist_core.tiers._retry import is_missing
from persist_core.tiers.local import checkpoint_dir, read_blocks, read_manifest


def resolve(manifest: Manifest, manifest_of: Callable[[int], Manifest], *, where: str) -> tuple[Manifest, set[str]]:
    """``manifest`` with each reference turned into a record of a listed file named ``step-N/<file>``, and those
    names.

    Args:
        manifest: a manifest whose records reference older checkpoints (``depends_on()``).
        manifest_of: the manifest of a committed checkpoint of the same tier, its files checked for presence and
            size (raises when it is missing or does not read; a remote's ``RemoteError`` for a manifest that is not
            there, its prefix removed by a lifecycle rule say, counts as missing).
        where: the referencing checkpoint, for messages.

    Raises:
        CorruptCheckpointError: a referenced checkpoint is missing or does not read, or does not hold the bytes
            referenced (the same entry of the same file, with the same hash, dtype and shape): the referencing
            checkpoint is corrupt too (the message names the step it references).
        RemoteError: the remote could not be read (not a missing object: a transient failure that outlasted the
            retries, a permission): nothing is known about the referenced checkpoint.
    """
    held: dict[int, _Held] = {}
    for step in sorted(manifest.depends_on()):
        try:
            held[step] = _Held(manifest_of(step))
        except (CorruptCheckpointError, CheckpointNotFoundError) as e:
            raise CorruptCheckpointError(f"{where} references bytes of step {step}, which does not read: {e}") from e
        except RemoteError as e:
            if not is_missing(e):
                raise
            raise CorruptCheckpointError(f"{where} references bytes of step {step}, which is gone from that tier (its "
                                         f"manifest is not there: {e})") from e
    files = {f.name: f for f in manifest.files}

    def held_file(step: int, file: str) -> str:
        """The name the referenced ``file`` of ``step`` takes in the resolved manifest (listed in ``files``)."""
        name = f"{checkpoint_dirname(step)}/{file}"
        entry = held[step].files.get(file)
        if entry is None:
            raise CorruptCheckpointError(f"{where} references {file} of step {step}, which does not hold it")
        files[name] = dataclasses.replace(entry, name=name)
        return name

    tensors = []
    for rec in manifest.tensors:
        if rec.chunks is not None and any(c.step is not None for c in rec.chunks):
            tensors.append(dataclasses.replace(rec, chunks=tuple(
                c if c.step is None else _resolved_chunk(c, held[c.step], held_file, where) for c in rec.chunks)))
            continue
        if rec.step is None:
            tensors.append(rec)
            continue
        match = held[rec.step].plain.get((rec.file, rec.entry, rec.offset, rec.stride, rec.dtype, rec.shape))
        if match is None or match.hash != rec.hash:
            raise CorruptCheckpointError(f"{where} references entry {rec.entry!r} of step {rec.step}'s {rec.file}, "
                                         f"which does not hold those bytes (no such tensor there, or another hash)")
        tensors.append(dataclasses.replace(rec, file=held_file(rec.step, rec.file), step=None))  # type: ignore[arg-type]
    return dataclasses.replace(manifest, tensors=tuple(tensors), files=tuple(files.values())), \
        set(files) - {f.name for f in manifest.files}


class _Held:
    """A referenced checkpoint's files, own plain records and own chunks, each indexed once (a load resolves every
    reference in constant time: an FSDP model has thousands of records, each with a chunk per rank)."""

    def __init__(self, m: Manifest) -> None:
        self.files = {f.name: f for f in m.held()}
        self.plain = {(p.file, p.entry, p.offset, p.stride, p.dtype, p.shape): p for p in m.tensors
                      if p.step is None and p.chunks is None}
        self.chunks = {(c.file, c.entry, c.offsets, c.sizes): c for r in m.tensors if r.chunks is not None
                       for c in r.chunks if c.step is None}


def _resolved_chunk(c: Chunk, other: _Held, held_file: Callable[[int, str], str], where: str) -> Chunk:
    """Chunk reference ``c`` as a chunk of the referenced file (:func:`resolve`), once ``other`` (the checkpoint it
    names) is seen to hold a chunk of that box with that hash in that entry."""
    match = other.chunks.get((c.file, c.entry, c.offsets, c.sizes))
    if match is None or match.hash != c.hash:
        raise CorruptCheckpointError(f"{where} references chunk {c.entry!r} of step {c.step}'s {c.file}, which does "
                                     "not hold those bytes (no such chunk there, or another hash)")
    return dataclasses.replace(c, file=held_file(c.step, c.file), step=None)  # type: ignore[arg-type]


def read_referenced(resolved: Manifest, names: set[str], *, read_blocks: ReadBlocks, pool: Executor,
                    stats: LoadStats | None = None) -> dict[str, tuple[dict[str, torch.Tensor], dict[str, str]]]:
    """The referenced entries of a resolved manifest (:func:`resolve`), read by ranges of verified blocks: per
    referenced file, one CPU byte tensor per entry read and the safetensors dtype its header gives each entry (what
    :func:`~persist_core.assembly.assemble.load_checkpoint` takes for a file)."""
    plan = ReadPlan(resolved, read_blocks, pool, stats if stats is not None else LoadStats())
    out: dict[str, tuple[dict[str, torch.Tensor], dict[str, str]]] = {name: ({}, {}) for name in names}
    places = [(c.file, c.entry) for rec in resolved.tensors for c in rec.chunks or ()]  # sharded: chunk by chunk
    places += [(rec.file, rec.entry) for rec in resolved.tensors if rec.chunks is None]
    for file, entry in places:
        if file not in names or entry in out[file][0]:
            continue
        begin, end = plan.entry(file, entry)
        t = torch.empty(end - begin, dtype=torch.uint8)
        out[file][0][entry] = t
        if end > begin:
            plan.request(file, begin, end, into=bytes_of(t))
    plan.run()
    for name, (_, dtypes) in out.items():
        dtypes.update(plan.dtypes(name) if out[name][0] else {})
    return out


def referenced_file(names: set[str], read_own: ReadBlocks, read_other: Callable[[str, FileEntry, int,
                    list[memoryview]], None]) -> ReadBlocks:
    """``read_blocks`` over a resolved manifest: a referenced file (one of ``names``) by ``read_other(name, ...)``,
    the checkpoint's own by ``read_own``."""
    def read(f: FileEntry, first: int, views: list[memoryview]) -> None:
        if f.name in names:
            read_other(f.name, f, first, views)
        else:
            read_own(f, first, views)

    return read


def split_name(name: str) -> tuple[int, str]:
    """``(step, file)`` of a referenced file's name in a resolved manifest (``step-N/<file>``)."""
    from persist_core.layout import parse_checkpoint_dirname

    head, _, fname = name.partition("/")
    step = parse_checkpoint_dirname(head)
    if step is None:
        raise CorruptCheckpointError(f"{name!r} is not a referenced file's name")
    return step, fname


def load_referencing(root: Path, ckpt: Path, manifest: Manifest, into: Any, *, options: LoadOptions, pool: Executor,
                     stats: LoadStats, read_own: ReadBlocks) -> tuple[Any, Manifest]:
    """The state of the local incremental checkpoint ``ckpt`` of ``local_dir`` ``root`` (its own files read by
    ``read_own``, or whole; the bytes it references read from the older checkpoints' files, verified by their
    checksums, each once): ``into`` filled in place, or whole with aliasing kept; and the resolved manifest (the
    files it read: the engine warms its staging buffers for saves of about that size).

    Raises:
        CorruptCheckpointError: a file it reads, or one it references, does not verify or is missing.
    """
    resolved, names = resolve(manifest, lambda s: read_manifest(checkpoint_dir(root, s)), where=str(ckpt))
    read = referenced_file(names, read_own, lambda name, f, first, views: read_blocks(root / name, f, first, views,
                                                                                      verify=options.verify))
    if into is not None:
        return load_into(resolved, into, pool=pool, options=options, where=str(ckpt), stats=stats,
                         read_blocks=read), resolved
    others = read_referenced(resolved, names, read_blocks=read, pool=pool, stats=stats)

    def shard(f: FileEntry) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        if f.name in others:
            return others[f.name]
        return _read_shard(ckpt / f.name, f, pool=pool, verify=options.verify)

    return load_checkpoint(ckpt, resolved, pool=pool, options=options, shard=shard), resolved
