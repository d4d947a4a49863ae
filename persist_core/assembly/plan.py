"""What a load needs, decided without I/O: how it reads (:class:`LoadOptions`), and for each target the byte
ranges of the saved chunks that the part it holds overlaps (resharding: any number of ranks, any mesh).

Pure: boxes, strides and byte offsets in, byte ranges out. Who calls what:
:func:`~persist_core.assembly.assemble.load_into` calls :func:`target_box` for each target and
:func:`chunk_read` for each saved chunk of its record, then requests the ranges it returns of a
:class:`~persist_core.assembly.blocks.ReadPlan`; :func:`slices` places a chunk in a tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from persist_core.errors import ConfigError, CorruptCheckpointError
from persist_core.format.records import TensorRecord
from persist_core.format.tree import is_dtensor
from persist_core.planning.partition import contiguous_strides

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in the global tensor


@dataclass(frozen=True)
class LoadOptions:
    """How a load reads: verify checksums, the device for tensors read whole, whose ``PerRank`` values, and
    whether non-tensor leaves are unpickled with the allowlist (``weights_only``, the default) or in full."""

    verify: bool = True
    map_location: Any = "cpu"
    rank: int = 0
    weights_only: bool = True


def check_weights_only(value: Any) -> bool:
    """``value`` if it is a bool; else a ConfigError (``weights_only="no"`` must not mean yes)."""
    if not isinstance(value, bool):
        raise ConfigError(f"weights_only={value!r} must be True (unpickle only the types training states hold) or "
                          "False (full pickle, for checkpoints you trust)")
    return value


def overlap(a: Box, b: Box) -> Box | None:
    """The intersection of two boxes, or ``None`` when they do not meet."""
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a[0], a[1], b[0], b[1]))
    if any(h <= l_ for l_, h in zip(lo, hi)):
        return None
    return lo, tuple(h - l_ for l_, h in zip(lo, hi))


def slices(box: Box, origin: tuple[int, ...]) -> tuple[slice, ...]:
    """The index of ``box`` in a tensor whose first element is at ``origin``."""
    return tuple(slice(o - p, o - p + n) for o, n, p in zip(box[0], box[1], origin))


def target_box(t: torch.Tensor) -> tuple[torch.Tensor, Box | None, tuple[int, ...]]:
    """``(the local tensor to fill, its box in the global tensor or None, the global shape)``."""
    if is_dtensor(t):
        if t.device_mesh.get_coordinate() is None:
            return t.to_local(), None, tuple(t.shape)
        chunks = t.__create_chunk_list__()
        local = t.to_local()
        if len(chunks) != 1:
            raise ConfigError(f"a DTensor target {tuple(t.placements)} holds {len(chunks)} boxes; redistribute it to "
                              "Shard/Replicate placements to load into it")
        return local.view(tuple(chunks[0].sizes)) if local.numel() else local, \
            (tuple(chunks[0].offsets), tuple(chunks[0].sizes)), tuple(t.shape)
    return t, ((0,) * t.dim(), tuple(t.shape)), tuple(t.shape)


@dataclass(frozen=True)
class SavedChunk:
    """One box of a saved tensor as the reads plan it: its elements from byte ``offset`` of entry ``entry`` of
    ``file``, laid out by ``stride`` (``None``: C-contiguous), at ``offsets`` in the global tensor, ``sizes`` big."""

    file: str
    entry: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    offset: int = 0
    stride: tuple[int, ...] | None = None


def saved_chunks(rec: TensorRecord) -> list[SavedChunk]:
    """The chunks a tensor record was saved as, as the reads plan them (a record that is not sharded: one chunk,
    the whole tensor, with its offset into the entry and its stride)."""
    if rec.chunks is not None:
        return [SavedChunk(c.file, c.entry, c.offsets, c.sizes) for c in rec.chunks]
    return [SavedChunk(rec.file, rec.entry, (0,) * len(rec.shape), rec.shape, rec.offset,  # type: ignore[arg-type]
                       rec.stride)]


@dataclass(frozen=True)
class ChunkRead:
    """The bytes of one saved chunk that a target's box overlaps.

    ``start``/``stop``: bytes from the start of the chunk's entry (its ``offset`` included); ``meet``: the
    overlap in the global tensor; ``strides``: the chunk's element strides; ``in_order``: the bytes are the
    overlap's elements, one contiguous run in order (so they can be read straight into a target)."""

    meet: Box
    start: int
    stop: int
    strides: tuple[int, ...]
    in_order: bool
    low: int  # the first byte the chunk may hold (its offset): ``start`` below it means a damaged record


def chunk_read(box: Box, c: SavedChunk, ndim: int, itemsize: int, path: str, where: str) -> ChunkRead | None:
    """The byte range of chunk ``c`` (of a tensor of ``ndim`` dimensions) that ``box`` overlaps, or ``None``.

    Raises:
        CorruptCheckpointError: the chunk has another number of dimensions than its tensor.
    """
    c_box = (c.offsets, c.sizes)
    if len(c_box[0]) != ndim:
        raise CorruptCheckpointError(f"{where}: a chunk of {path!r} has {len(c_box[0])} dimensions, the tensor "
                                     f"{ndim}")
    meet = overlap(box, c_box)
    if meet is None:
        return None
    low = c.offset
    c_strides = c.stride if c.stride is not None else contiguous_strides(c_box[1])
    rel = tuple(lo - o for lo, o in zip(meet[0], c_box[0]))
    first = sum(r * s for r, s in zip(rel, c_strides))
    last = sum((r + n - 1) * s for r, n, s in zip(rel, meet[1], c_strides))
    return ChunkRead(meet, low + first * itemsize, low + (last + 1) * itemsize, c_strides,
                     last - first + 1 == math.prod(meet[1]), low)
