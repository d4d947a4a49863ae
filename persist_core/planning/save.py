"""What one rank writes: the byte layout of its shard file and where each byte comes from.

:func:`plan_shard` turns a flattened state (and, with several ranks, the owner of each storage
group) into a :class:`ShardPlan`: the header bytes, the copies that fill the data section, and
the manifest records. The staging copy (:mod:`persist_core.staging`) executes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from persist_core._knobs import ENTRY_ALIGN_BYTES, PAGE_BYTES
from persist_core.format.shard_file import (
    FORMAT_NAME,
    FORMAT_VERSION,
    OBJECTS_ENTRY,
    _RESERVED_PREFIXES,
    dtype_name,
    encode_header,
    safetensors_dtype,
)
from persist_core.format.manifest import Manifest
from persist_core.format.tree import FlatState, flatten
from persist_core.layout import shard_filename
from persist_core.planning.partition import _span, assign_owners, storage_groups, structure_signature


@dataclass(frozen=True)
class EntryCopy:
    """Copy ``source`` (viewed as ``dtype``/``shape``) into the data bytes ``[begin, end)``."""

    begin: int
    end: int
    source: torch.Tensor | bytes
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ShardPlan:
    """Where each byte of one shard file comes from. Holds references to the source tensors.

    Attributes:
        header: the file's first ``len(header)`` bytes (a multiple of 4 KiB).
        file_bytes: total file size (a multiple of 4 KiB).
        copies: what to copy where; offsets are relative to the data section.
        records: one per state tensor, for the manifest (entry, dtype, shape, stride, offset);
            ``None`` for a tensor another rank writes.
        objects: ``(begin, length)`` of each pickled leaf inside the ``__objects__`` entry.
    """

    header: bytes
    file_bytes: int
    copies: list[EntryCopy]
    records: list[dict[str, Any] | None]
    objects: list[tuple[int, int]]

    @property
    def data_bytes(self) -> int:
        return self.file_bytes - len(self.header)


def plan_shard(flat: FlatState, *, groups: list[list[int]] | None = None, owners: list[int] | None = None,
               rank: int = 0) -> ShardPlan:
    """Lay out one shard file for ``flat`` (see the module docstring).

    With ``owners`` (one rank per storage group, see :func:`assign_owners`), only the groups
    ``rank`` owns are laid out, and the pickled objects only on rank 0; the records of the
    other tensors are ``None``.
    """
    groups = storage_groups(flat) if groups is None else groups

    names: set[str] = set()

    def unique(path: str, *, internal: bool = False) -> str:
        base = path or "<root>"
        if not internal and base.startswith(_RESERVED_PREFIXES):
            base = "_" + base  # user keys never take an internal entry's name
        name, n = base, 0
        while name in names:
            n += 1
            name = f"{base}#{n}"
        names.add(name)
        return name

    pending: list[tuple[str, str, list[int], int, Any, torch.dtype, tuple[int, ...]]] = []
    records: list[dict[str, Any] | None] = [None for _ in flat.tensors]
    for n_shared, idxs in enumerate(groups):
        if owners is not None and owners[n_shared] != rank:
            continue
        if len(idxs) == 1:
            path, t = flat.tensors[idxs[0]]
            name = unique(path)
            nbytes = t.numel() * t.element_size()
            st = safetensors_dtype(t.dtype)
            shape = list(t.shape) if st else [nbytes]
            pending.append((name, st or "U8", shape, nbytes, t, t.dtype, tuple(t.shape)))
            records[idxs[0]] = {"entry": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape), "stride": None, "offset": 0}
            continue
        spans = [_span(flat.tensors[i][1]) for i in idxs]
        lo = min(b for b, _ in spans) // ENTRY_ALIGN_BYTES * ENTRY_ALIGN_BYTES
        hi = max(e for _, e in spans)
        first = flat.tensors[idxs[0]][1]
        base = torch.empty(0, dtype=torch.uint8, device=first.device).set_(first.untyped_storage(), lo, (hi - lo,), (1,))
        name = unique(f"__shared__.{n_shared}", internal=True)
        pending.append((name, "U8", [hi - lo], hi - lo, base, torch.uint8, (hi - lo,)))
        for i, (b, _) in zip(idxs, spans):
            t = flat.tensors[i][1]
            records[i] = {"entry": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape), "stride": list(t.stride()), "offset": b - lo}

    objects: list[tuple[int, int]] = []
    if flat.objects and rank == 0:
        blob = b"".join(flat.objects)
        pos = 0
        for o in flat.objects:
            objects.append((pos, len(o)))
            pos += len(o)
        pending.append((OBJECTS_ENTRY, "U8", [len(blob)], len(blob), blob, torch.uint8, (len(blob),)))

    header_entries: dict[str, Any] = {"__metadata__": {"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION)}}
    copies: list[EntryCopy] = []
    pos = 0
    n_pad = 0

    def pad_to(align: int) -> None:
        nonlocal pos, n_pad
        gap = -pos % align
        if gap:
            header_entries[f"__pad__.{n_pad}"] = {"dtype": "U8", "shape": [gap], "data_offsets": [pos, pos + gap]}
            n_pad += 1
            pos += gap

    for name, st, shape, nbytes, source, dtype, tshape in pending:
        pad_to(ENTRY_ALIGN_BYTES)
        header_entries[name] = {"dtype": st, "shape": shape, "data_offsets": [pos, pos + nbytes]}
        if nbytes:
            copies.append(EntryCopy(pos, pos + nbytes, source, dtype, tshape))
        pos += nbytes
    pad_to(PAGE_BYTES)

    header = encode_header(header_entries)
    return ShardPlan(header=header, file_bytes=len(header) + pos, copies=copies, records=records, objects=objects)



@dataclass(frozen=True)
class RankPlan:
    """What one rank writes of a state: the flattened state, its shard plan, and the structure digest."""

    flat: FlatState
    shard: ShardPlan
    signature: str  # "" with one rank; ranks compare it before committing
    rank: int

    def manifest(self, *, step: int, time: float, metadata: dict[str, Any] | None) -> Manifest:
        """This rank's manifest so far: records for the tensors it writes, no files yet (the commit adds them)."""
        shard = shard_filename(self.rank)
        records = tuple(None if r is None else {"file": shard, **r, "replicated": True} for r in self.shard.records)
        return Manifest(step=step, time=time, world_size=1, tree=self.flat.tree, tensors=records,
                        objects=tuple((shard, b, n) for b, n in self.shard.objects), files=(),
                        metadata=dict(metadata or {}))


def plan_rank(state: Any, *, rank: int, world_size: int) -> RankPlan:
    """Flatten ``state`` and lay out ``rank``'s shard of it (about ``1/world_size`` of a replicated state).

    Raises:
        UnsupportedStateError: a leaf cannot be saved (its key path is named).
    """
    flat = flatten(state)
    groups = storage_groups(flat)
    owners = assign_owners(flat, groups, world_size) if world_size > 1 else None
    shard = plan_shard(flat, groups=groups, owners=owners, rank=rank)
    return RankPlan(flat=flat, shard=shard, signature=structure_signature(flat, groups) if owners is not None else "",
                    rank=rank)
