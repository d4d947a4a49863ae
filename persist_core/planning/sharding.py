"""Sharded leaves: what a ``DTensor`` holds on this rank, and the check that replicated tensors are.

:func:`localize` turns the ``DTensor`` leaves of a flattened state into their local tensors and a
:class:`Sharding` each (the global shape, the box this rank holds, whether this rank is the
replica that writes it). :func:`replica_digests` digests the plain tensors of a state that several
ranks save as replicated, so the commit can find one that is not (the ranks compare digests).

Who calls what: :func:`persist_core.planning.save.plan_rank` calls both, on the training thread,
before staging; the commit compares the digests (:mod:`persist_core.save.commit`).
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from typing import Any

import crc32c
import numpy as np
import torch

from persist_core.errors import ConfigError, UnsupportedStateError
from persist_core.format.tree import FlatState, is_dtensor

REPLICA_CHECKS = ("sampled", "full", "off")
_SAMPLES = 16  # elements per tensor a sampled digest reads (and its first and last)


@dataclass(frozen=True)
class Sharding:
    """One rank's part of a sharded tensor: the box ``offsets``/``sizes`` of a ``shape`` tensor.

    The box is the part this rank *writes*: the ranks holding the same local part (the replicas
    along the ``Replicate`` mesh dimensions) split it along its first dimension, so each writes
    about ``1/replicas`` of it; ``writes`` is False when this rank's share is empty.
    ``placements``/``mesh`` describe the layout for people (``persist inspect``); loading needs
    only the boxes.
    """

    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    writes: bool
    placements: str
    mesh: tuple[int, ...]


def describe(t: Any, path: str, *, split: bool = True) -> tuple[torch.Tensor, Sharding]:
    """``(local tensor, Sharding)`` of the ``DTensor`` ``t`` (at key path ``path``). ``split=False``: the whole
    local part, whatever other ranks hold the same (a memory snapshot: the rank's own state, restored alone).

    Raises:
        UnsupportedStateError: a ``Partial`` placement (no rank holds the value), or a layout whose
            local part is not one box of the global tensor.
    """
    placements = tuple(t.placements)
    if any(p.is_partial() for p in placements):
        raise UnsupportedStateError(
            f"state[{path!r}] is a DTensor with a Partial placement {placements}: no rank holds its value; "
            "reduce it first (t.redistribute(placements=[Replicate()] * mesh.ndim)) or save t.full_tensor()")
    local = t.to_local().detach()
    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:  # this rank is not on the tensor's mesh: it holds nothing of it
        empty = (0,) * len(t.shape)
        return local, Sharding(tuple(t.shape), empty, empty, False, str(placements), tuple(mesh.shape))
    chunks = t.__create_chunk_list__()
    if len(chunks) != 1 or math.prod(chunks[0].sizes) != local.numel():
        raise UnsupportedStateError(
            f"state[{path!r}] is a DTensor {placements} whose local part is not one box of the global tensor "
            f"({len(chunks)} chunks); redistribute it to Shard/Replicate placements before saving")
    offsets, sizes = list(chunks[0].offsets), list(chunks[0].sizes)
    local = local.reshape(sizes) if local.numel() else local
    replicas = [d for d, p in enumerate(placements) if p.is_replicate()]
    count = math.prod(mesh.shape[d] for d in replicas)
    index = 0
    for d in replicas:  # this rank's place among the ranks holding the same box
        index = index * mesh.shape[d] + coord[d]
    if not split:
        count, index = 1, 0
    if count > 1:  # the replicas split the box along its first dimension: each writes about 1/count of it
        if not sizes:
            return local, Sharding(tuple(t.shape), (), (), index == 0, str(placements), tuple(mesh.shape))
        begin, end = index * sizes[0] // count, (index + 1) * sizes[0] // count
        local = local[begin:end]
        offsets[0] += begin
        sizes[0] = end - begin
    writes = math.prod(sizes) > 0 or (not sizes and index == 0)
    return local, Sharding(tuple(t.shape), tuple(offsets), tuple(sizes), writes, str(placements), tuple(mesh.shape))


def localize(flat: FlatState, *, split: bool = True) -> tuple[FlatState, dict[int, Sharding]]:
    """``flat`` with each ``DTensor`` replaced by its local tensor, and the :class:`Sharding` of each, by index
    (``split``: see :func:`describe`)."""
    shardings: dict[int, Sharding] = {}
    tensors = list(flat.tensors)
    for i, (path, t) in enumerate(tensors):
        if is_dtensor(t):
            local, shardings[i] = describe(t, path, split=split)
            tensors[i] = (path, local)
    if not shardings:
        return flat, shardings
    return dataclasses.replace(flat, tensors=tensors), shardings


def replica_digests(flat: FlatState, skip: dict[int, Any], *, mode: str, seed: int) -> list[int | None]:
    """A digest per tensor of ``flat`` that every rank holds alike (``None`` for those in ``skip``).

    ``"sampled"``: the bytes of the first, the last and ``_SAMPLES`` elements at offsets drawn
    from ``seed`` (every rank draws the same; the engine draws anew each save), so a tensor that
    differs from rank to rank almost anywhere is caught at a cost that does not grow with its
    size (a few microseconds for a CPU tensor). ``"full"``: every byte. ``"off"``: nothing.
    """
    if mode == "off":
        return [None] * len(flat.tensors)
    fractions = np.array([0.0, *sorted(random.Random(seed).random() for _ in range(_SAMPLES)), 1.0])
    digests: list[int | None] = []
    for i, (_, t) in enumerate(flat.tensors):
        if i in skip:
            digests.append(None)
            continue
        n = t.numel()
        if n == 0:
            digests.append(0)
            continue
        t = t.detach()
        if mode == "full":
            digests.append(crc32c.crc32c(t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()))
            continue
        picks = np.minimum((fractions * n).astype(np.int64), n - 1)
        if t.device.type == "cpu" and t.is_contiguous():  # numpy on the bytes: no torch op per element
            es = t.element_size()
            raw = t.reshape(-1).view(torch.uint8).numpy()
            sample = raw[(picks[:, None] * es + np.arange(es)).reshape(-1)]
        else:  # another device, or strided: gather the elements with torch
            coords = np.unravel_index(picks, tuple(t.shape)) if t.dim() else ()
            values = t[tuple(torch.from_numpy(c).to(t.device) for c in coords)] if t.dim() else t.reshape(1)
            sample = values.contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        digests.append(crc32c.crc32c(sample.tobytes()))
    return digests


def check_replica_mode(mode: str) -> str:
    """``mode`` if it is one of :data:`REPLICA_CHECKS`; else a ConfigError naming them."""
    if mode not in REPLICA_CHECKS:
        raise ConfigError(f"replica_check={mode!r} must be one of {', '.join(map(repr, REPLICA_CHECKS))}")
    return mode
