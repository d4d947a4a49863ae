"""Leaf digests (resume verification, issue 55, format version 7): the xxh3-128 (hex) of a tensor's elements in C
order, the same from staged bytes (:func:`staged_digest`, the writer thread's) and from a live tensor
(:func:`tensor_digest`, the resume side's: a device tensor copied to the host in pieces, never a second full copy of
the state at once). Pure: no I/O."""

from __future__ import annotations

import torch
import xxhash

from persist_core.format.records import TensorRecord
from persist_core.format.shard_file import dtype_from_name, itemsize

__all__ = ["PIECE_BYTES", "contiguous", "staged_digest", "tensor_digest"]

#: bytes of a device tensor copied to the host at a time for its digest
PIECE_BYTES = 64 << 20


def contiguous(r: TensorRecord) -> bool:
    """Whether a plain record's elements lie in C order (no stride, or the C-contiguous one)."""
    if r.stride is None:
        return True
    expected, n = [], 1
    for d in reversed(r.shape):
        expected.append(n)
        n *= d
    return all(s == e for s, e, d in zip(r.stride, reversed(expected), r.shape) if d > 1)


def staged_digest(r: TensorRecord, view: memoryview, start: int) -> str:
    """The digest of the plain tensor ``r`` whose entry starts at byte ``start`` of ``view`` (a staged shard)."""
    dtype = dtype_from_name(r.dtype)
    size = itemsize(dtype)
    numel = 1
    for d in r.shape:
        numel *= d
    begin = start + r.offset
    if numel == 0:
        return xxhash.xxh3_128_hexdigest(b"")
    if contiguous(r):
        return xxhash.xxh3_128_hexdigest(view[begin : begin + numel * size])
    extent = 1 + sum((d - 1) * s for d, s in zip(r.shape, r.stride or ()))
    raw = torch.frombuffer(view[begin : begin + extent * size], dtype=torch.uint8).view(dtype)
    return tensor_digest(raw.as_strided(r.shape, r.stride))  # type: ignore[arg-type]


def tensor_digest(t: torch.Tensor) -> str:
    """The xxh3-128 (hex) of ``t``'s elements in C order, as :func:`with_digests` records it; a device tensor is
    copied to the host ``PIECE_BYTES`` at a time."""
    t = t.detach().resolve_conj().resolve_neg()
    if t.numel() == 0:
        return xxhash.xxh3_128_hexdigest(b"")
    flat = t.reshape(-1)  # a copy only where t is not contiguous (one tensor, on its own device)
    if flat.device.type == "cpu":
        return xxhash.xxh3_128_hexdigest(flat.contiguous().view(torch.uint8).numpy())
    h = xxhash.xxh3_128()
    per = max(1, PIECE_BYTES // flat.element_size())
    for i in range(0, flat.numel(), per):
        h.update(flat[i : i + per].cpu().contiguous().view(torch.uint8).numpy())
    return h.hexdigest()
