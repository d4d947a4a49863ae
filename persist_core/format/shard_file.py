"""The shard file layout (version 1): safetensors layout, aligned for ``O_DIRECT``.

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

:mod:`persist_core.planning.save` lays a shard out with :func:`encode_header`; readers take it
apart with :func:`parse_header`.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import torch

from persist_core._knobs import PAGE_BYTES
from persist_core.errors import CorruptCheckpointError
from persist_core.format.torch_zip import image_offset

FORMAT_NAME = "torch-persist"


FORMAT_VERSION = 5  # 2: the manifest's own crc32c; 3: torch-loadable shards; 4: sharded tensors, PerRank values;
# 5: node-local copies (the manifest's nodes and node). What shards, and manifests without references, are written as.
# 6 (format/records.py REFERENCES_VERSION): records referencing an older checkpoint's bytes, written only by a manifest
# that holds one (Manifest.version). 7 (DIGESTS_VERSION): leaf digests and lineage in the manifest (resume
# verification), every manifest a save writes. Readers take every older one (format/manifest.py READ_VERSION).


OBJECTS_ENTRY = "__objects__"
PER_RANK_ENTRY = "__per_rank__"  # this rank's PerRank values, pickled (each rank's shard has its own)


_RESERVED_PREFIXES = ("__pad__", "__shared__", OBJECTS_ENTRY, PER_RANK_ENTRY, "__metadata__")


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



def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty(0, dtype=dtype).element_size()


def whole_entry_mismatch(header_dtype: str | None, nbytes: int, dtype: torch.dtype, numel: int) -> str | None:
    """Why a record of ``numel`` elements of ``dtype`` that fills a whole entry does not fit it (its header
    names ``header_dtype``, its data is ``nbytes``): a dtype swapped for another of the same size, or the
    wrong size; ``None`` when it fits. Both load paths ask this."""
    named = safetensors_dtype(dtype) or "U8"
    if header_dtype != named:
        return f"the record says {dtype_name(dtype)} but its shard entry holds {header_dtype}"
    if numel * itemsize(dtype) != nbytes:
        return f"{numel} x {itemsize(dtype)} bytes do not make the entry's {nbytes}"
    return None


def safetensors_dtype(dtype: torch.dtype) -> str | None:
    """The safetensors name of ``dtype`` (``"F32"``), or ``None`` when it has none (stored as bytes)."""
    return _SAFETENSORS_DTYPES.get(dtype)


def encode_header(entries: dict[str, Any]) -> bytes:
    """The header bytes for ``entries`` (safetensors JSON), space-padded so data starts on 4 KiB."""
    raw = json.dumps(entries, separators=(",", ":")).encode()
    padded_len = -(8 + len(raw)) % PAGE_BYTES + len(raw)
    return struct.pack("<Q", padded_len) + raw + b" " * (padded_len - len(raw))


def parse_header(prefix: bytes, *, file_size: int) -> tuple[int, list[tuple[str, int, int]]]:
    """``(data_start, [(name, begin, end), ...])`` from a shard's first bytes, entries in file order.

    ``begin``/``end`` are absolute file offsets. The entries must tile the file from the end of
    the header to ``file_size`` with no hole or overlap.

    A torch-loadable shard (:mod:`persist_core.format.torch_zip`) starts with a zip local header;
    the layout behind it is read the same way, its offsets shifted by the header's length.

    Raises:
        CorruptCheckpointError: the bytes are not such a safetensors header.
    """
    skip = image_offset(prefix)
    if skip:
        data_start, spans = parse_header(prefix[skip:], file_size=file_size - skip)
        return skip + data_start, [(name, skip + b, skip + e) for name, b, e in spans]
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



def entry_dtypes(prefix: bytes) -> dict[str, str]:
    """The safetensors dtype (``"F32"``, ``"U8"``) of each entry of a shard whose first bytes are ``prefix``
    (already checked by :func:`parse_header`): a reader compares it with the manifest's record."""
    skip = image_offset(prefix)
    (n,) = struct.unpack("<Q", prefix[skip : skip + 8])
    header = json.loads(prefix[skip + 8 : skip + 8 + n])
    return {str(name): str(e.get("dtype")) for name, e in header.items() if name != "__metadata__"}
