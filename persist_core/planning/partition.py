"""Who writes what: storage groups (tensors sharing memory) and their owners across ranks.

Pure functions of a flattened state; every rank computes the same answer.
"""

from __future__ import annotations

import json
from collections.abc import Container, Mapping
from typing import Any

import crc32c
import torch

from persist_core.format.shard_file import dtype_name
from persist_core.format.tree import FlatState


def _span(t: torch.Tensor) -> tuple[int, int]:
    """Byte range ``[begin, end)`` of ``t`` inside its untyped storage."""
    es = t.element_size()
    begin = t.storage_offset() * es
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return begin, begin + (last + 1) * es


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a C-contiguous tensor of ``shape``."""
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def storage_groups(flat: FlatState, skip: Container[int] = ()) -> list[list[int]]:
    """Indices of ``flat.tensors`` (but those in ``skip``: sharded) grouped by the storage they share,
    in first-seen order."""
    groups: dict[Any, list[int]] = {}
    for i, (_, t) in enumerate(flat.tensors):
        if i in skip:
            continue
        key = ("empty", i) if t.numel() == 0 else (t.device, t.untyped_storage().data_ptr())
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def _group_bytes(flat: FlatState, idxs: list[int]) -> int:
    if len(idxs) == 1:
        t = flat.tensors[idxs[0]][1]
        return t.numel() * t.element_size()
    spans = [_span(flat.tensors[i][1]) for i in idxs]
    return max(e for _, e in spans) - min(b for b, _ in spans)


def assign_owners(flat: FlatState, groups: list[list[int]], world_size: int) -> list[int]:
    """Which rank writes each storage group of a state every rank holds alike (replicated).

    Largest group first to the least loaded rank (ties: the lower rank), so each rank writes
    about ``1/world_size`` of the bytes. Deterministic: every rank computes the same answer.
    """
    load = [0] * world_size
    owners = [0] * len(groups)
    order = sorted(range(len(groups)), key=lambda g: (-_group_bytes(flat, groups[g]), g))
    for g in order:
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[g] = rank
        load[rank] += _group_bytes(flat, groups[g])
    return owners



def structure_signature(flat: FlatState, groups: list[list[int]], shardings: Mapping[int, Any] | None = None) -> str:
    """A digest of the state's structure (paths, dtypes, shapes — global ones for sharded tensors —,
    shared storages) that ranks compare."""
    shardings = shardings or {}
    described = [[p, dtype_name(t.dtype), list(shardings[i].shape) if i in shardings else list(t.shape)]
                 for i, (p, t) in enumerate(flat.tensors)]
    return f"{crc32c.crc32c(json.dumps([described, groups]).encode()):08x}"
