"""The shard file layout (version 1) and the encoding of a state's tree.

A shard file is in safetensors layout, so ``safetensors.safe_open`` reads it::

    [8-byte little-endian header length][JSON header, space-padded][data section]

* The header is padded so that the data section starts on a 4 KiB boundary, and a final
  ``__pad__`` entry makes the file a multiple of 4 KiB: every write can be ``O_DIRECT``.
* Every entry starts on a 64-byte boundary (``__pad__.N`` entries fill the gaps, since
  safetensors forbids holes), so any dtype can be viewed in place.
* A tensor that shares its storage with no other tensor of the state is one entry under its key
  path (``model/layer.weight``) with its own dtype and shape. Tensors sharing a storage (tied
  weights, views) are one ``__shared__.N`` byte entry spanning them; the manifest records each
  tensor's offset and strides in it, so aliasing survives a round trip.
* Leaves that are not tensors, containers or JSON scalars are pickled at save time into one
  ``__objects__`` entry.

The tree (nested dict / OrderedDict / list / tuple) is encoded as JSON for the manifest by
:func:`flatten` and rebuilt by :func:`unflatten`.
"""

from __future__ import annotations

import json
import pickle
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from persist_core._knobs import ENTRY_ALIGN_BYTES, PAGE_BYTES
from persist_core.errors import CorruptCheckpointError, UnsupportedStateError

FORMAT_NAME = "torch-persist"
FORMAT_VERSION = 1
OBJECTS_ENTRY = "__objects__"
_RESERVED_PREFIXES = ("__pad__", "__shared__", OBJECTS_ENTRY, "__metadata__")

_SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.uint16: "U16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.uint32: "U32",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.uint64: "U64",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fn: "F8_E4M3",
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; raises :class:`CorruptCheckpointError` for unknown names."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"unknown dtype {name!r} in manifest; was it written by a newer torch?")
    return dtype


# --------------------------------------------------------------------------- the tree


@dataclass(frozen=True)
class FlatState:
    """A state taken apart: a JSON-able tree, its tensors (in tree order) and pickled leaves."""

    tree: Any
    tensors: list[tuple[str, torch.Tensor]]
    objects: list[bytes]


def _check_tensor(t: torch.Tensor, path: str) -> None:
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise UnsupportedStateError(
            f"state[{path!r}] is a {type(t).__name__}, a tensor subclass torch-persist cannot snapshot; "
            "save a plain tensor (e.g. DTensor.full_tensor() or .to_local())"
        )
    if t.layout != torch.strided or t.is_quantized or t.is_nested or t.is_meta:
        raise UnsupportedStateError(
            f"state[{path!r}] is a {t.layout} / quantized / nested / meta tensor, which has no dense bytes "
            "to write; convert it (e.g. .to_dense(), .dequantize()) before saving"
        )


def _join(path: str, key: Any) -> str:
    return f"{path}/{key}" if path else str(key)


def flatten(state: Any) -> FlatState:
    """Take ``state`` apart; non-JSON leaves are pickled now, so later mutation cannot leak in.

    Raises:
        UnsupportedStateError: a leaf cannot be saved; the message names its key path.
    """
    tensors: list[tuple[str, torch.Tensor]] = []
    objects: list[bytes] = []

    def enc(obj: Any, path: str) -> Any:
        kind = type(obj)
        if isinstance(obj, torch.Tensor):
            _check_tensor(obj, path)
            tensors.append((path, obj))
            return {"tensor": len(tensors) - 1}
        if obj is None or kind in (bool, int, float, str):
            return {"value": obj}
        if kind is dict or kind is OrderedDict:
            items = [[enc(k, _join(path, "<key>")), enc(v, _join(path, k))] for k, v in obj.items()]
            return {"dict": items, "ordered": kind is OrderedDict}
        if kind is list:
            return {"list": [enc(v, _join(path, i)) for i, v in enumerate(obj)]}
        if kind is tuple:
            return {"tuple": [enc(v, _join(path, i)) for i, v in enumerate(obj)]}
        try:
            objects.append(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception as e:  # pickle raises many types: PicklingError, TypeError, AttributeError
            raise UnsupportedStateError(
                f"state[{path!r}] ({kind.__module__}.{kind.__qualname__}) cannot be saved: {e}. "
                "Keep tensors, dicts, lists, tuples and picklable values in the state, "
                "or convert this value before saving"
            ) from e
        return {"object": len(objects) - 1}

    tree = enc(state, "")
    return FlatState(tree=tree, tensors=tensors, objects=objects)


def unflatten(tree: Any, tensors: list[torch.Tensor], objects: list[Any]) -> Any:
    """Rebuild the state from :func:`flatten`'s tree, loaded tensors and unpickled objects."""

    def dec(node: Any) -> Any:
        if "tensor" in node:
            return tensors[node["tensor"]]
        if "value" in node:
            return node["value"]
        if "dict" in node:
            pairs = ((dec(k), dec(v)) for k, v in node["dict"])
            return OrderedDict(pairs) if node.get("ordered") else dict(pairs)
        if "list" in node:
            return [dec(v) for v in node["list"]]
        if "tuple" in node:
            return tuple(dec(v) for v in node["tuple"])
        if "object" in node:
            return objects[node["object"]]
        raise CorruptCheckpointError(f"unknown node {sorted(node)} in the manifest's tree")

    return dec(tree)


# --------------------------------------------------------------------------- the shard plan


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


def _span(t: torch.Tensor) -> tuple[int, int]:
    """Byte range ``[begin, end)`` of ``t`` inside its untyped storage."""
    es = t.element_size()
    begin = t.storage_offset() * es
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return begin, begin + (last + 1) * es


def storage_groups(flat: FlatState) -> list[list[int]]:
    """Indices of ``flat.tensors`` grouped by the storage they share, in first-seen order."""
    groups: dict[Any, list[int]] = {}
    for i, (_, t) in enumerate(flat.tensors):
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
            st = _SAFETENSORS_DTYPES.get(t.dtype)
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

    raw = json.dumps(header_entries, separators=(",", ":")).encode()
    padded_len = -(8 + len(raw)) % PAGE_BYTES + len(raw)
    header = struct.pack("<Q", padded_len) + raw + b" " * (padded_len - len(raw))
    return ShardPlan(header=header, file_bytes=len(header) + pos, copies=copies, records=records, objects=objects)


def parse_header(prefix: bytes, *, file_size: int) -> tuple[int, list[tuple[str, int, int]]]:
    """``(data_start, [(name, begin, end), ...])`` from a shard's first bytes, entries in file order.

    ``begin``/``end`` are absolute file offsets. The entries must tile the file from the end of
    the header to ``file_size`` with no hole or overlap.

    Raises:
        CorruptCheckpointError: the bytes are not such a safetensors header.
    """
    if len(prefix) < 8:
        raise CorruptCheckpointError("shard file is shorter than its 8-byte header length")
    (n,) = struct.unpack("<Q", prefix[:8])
    if 8 + n > len(prefix):
        raise CorruptCheckpointError(f"shard header claims {n} bytes but only {len(prefix) - 8} are there")
    data_start = 8 + n
    try:
        header = json.loads(prefix[8:data_start])
        header.pop("__metadata__", None)
        spans = sorted((data_start + int(e["data_offsets"][0]), data_start + int(e["data_offsets"][1]), str(name))
                       for name, e in header.items())
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise CorruptCheckpointError(f"shard header does not parse: {type(e).__name__}: {e}") from e
    pos = data_start
    for begin, end, name in spans:
        if begin != pos or end < begin:
            raise CorruptCheckpointError(f"shard entry {name!r} at bytes {begin}..{end} leaves a hole or overlaps")
        pos = end
    if pos != file_size:
        raise CorruptCheckpointError(f"shard entries end at byte {pos} but the file has {file_size}")
    return data_start, [(name, begin, end) for begin, end, name in spans]
