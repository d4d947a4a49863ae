"""Shards ``torch.load`` reads too: ``torch.save``'s zip records inside the safetensors layout.

A single writer's shard (``torch_loadable``) is one file that is at once the uncompressed zip
archive ``torch.save`` writes, so ``torch.load`` (also ``mmap=True``, ``weights_only=True``) and
``LightningModule.load_from_checkpoint`` read it, and our shard layout behind one zip local header,
so our readers read it as always::

    [local header of archive/.persist_header, padded to 4 KiB]
    [safetensors header (the record's data)][__pad__: local header][tensor bytes][__pad__: ...][tensor bytes]...
    [__pad__.zip: archive/data.pkl, byteorder, version ..., central directory, end of central directory]

``torch.load`` wants the file to start with a zip local header, ``safe_open`` with the safetensors
header length, so these shards do not open with ``safe_open`` (the others do): our reader skips
the first local header (:func:`image_offset`) and reads the safetensors layout behind it.

* Every tensor entry's bytes are the zip record ``archive/data/K`` (stored, not compressed): its
  30-byte local header sits at the end of the ``__pad__`` entry before it, so the tensor bytes are
  written exactly where and as they are without it (64-byte aligned, ``O_DIRECT``, one pass).
* The last entry holds ``archive/data.pkl`` (the state pickled as ``torch.save`` pickles it:
  protocol 2, tensors as ``torch._utils._rebuild_tensor_v2`` over persistent storage ids), the
  small records torch writes, the central directory (ZIP64 where an offset or size needs it) and
  the end record, whose comment pads the file to 4 KiB.
* The zip CRC-32 fields are 0: ``torch.load`` never checks them (its miniz is built without CRC
  checks), computing them would cost a second pass over every byte (about 2 GB/s per core here),
  and our own loads verify every chunk's crc32c. A strict zip tool (``unzip -t``, Python's
  ``zipfile`` reading a member) reports bad CRCs; ``torch.load`` of a ``.ckpt`` is unverified.

* A shard that holds no whole state pickles a call that raises an error saying how to load it instead:
  rank 0's of a split state (:class:`SplitShard`), and an incremental save's compacted one
  (:class:`ReferencingShard`, issue 53), whose global's name itself says the fix (``torch.load``'s
  ``weights_only=True`` refuses it and its error shows the name).

:func:`zip_plan` decides whether a state can be written so (every tensor's dtype has a torch
storage type and each storage group holds one dtype) and pickles it; :func:`local_header` and
:func:`zip_tail` make the bytes the planner places.
"""

from __future__ import annotations

import collections
import hashlib
import io
import pickle
import struct
from dataclasses import dataclass
from typing import Any

import torch

from persist_core.errors import PersistError

ARCHIVE = "archive"
PICKLE_PROTOCOL = 2  # what torch.save writes; torch's weights_only unpickler reads it
_ZIP64_LIMIT = 0xFFFFFFFF  # a module constant, so tests can cross it with small files
_DOS_DATE = 0x21  # 1980-01-01
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_EOCD = struct.Struct("<IHHHHIIH")
_EOCD64 = struct.Struct("<IQHHIIQQQQ")
_LOCATOR64 = struct.Struct("<IIQI")


HEADER_RECORD = f"{ARCHIVE}/.persist_header".encode()
ZIP_MAGIC = b"PK\x03\x04"
_PAD_EXTRA_ID = 0x7470  # an extra field no reader knows: it only pads the first local header


def image_offset(prefix: bytes) -> int:
    """Where the safetensors layout starts in a shard whose first bytes are ``prefix``: 0, or past
    the first zip local header of a torch-loadable shard."""
    if prefix[:4] != ZIP_MAGIC or len(prefix) < _LOCAL.size:
        return 0
    name_len, extra_len = struct.unpack_from("<HH", prefix, 26)
    return _LOCAL.size + name_len + extra_len


def header_record(size: int, total: int) -> bytes:
    """The file's first bytes: the local header of ``archive/.persist_header`` (``size`` bytes of
    data: the safetensors header), padded with an extra field to ``total`` bytes."""
    pad = total - _LOCAL.size - len(HEADER_RECORD) - 4
    if not 0 <= pad <= 0xFFFF:
        raise ValueError(f"cannot pad a local header to {total} bytes")
    extra = struct.pack("<HH", _PAD_EXTRA_ID, pad) + bytes(pad)
    return _LOCAL.pack(0x04034B50, 20, 0, 0, 0, _DOS_DATE, 0, size, size, len(HEADER_RECORD), len(extra)) + \
        HEADER_RECORD + extra


def record_name(key: str) -> bytes:
    """The zip name of storage ``key``: ``archive/data/<key>``."""
    return f"{ARCHIVE}/data/{key}".encode()


def local_header(name: bytes, size: int) -> bytes:
    """The local file header of a stored record of ``size`` bytes (ZIP64 when it needs it)."""
    extra = b""
    field = size
    if size >= _ZIP64_LIMIT:
        extra = struct.pack("<HHQQ", 1, 16, size, size)
        field = 0xFFFFFFFF
    return _LOCAL.pack(0x04034B50, 45 if extra else 20, 0, 0, 0, _DOS_DATE, 0, field, field, len(name),
                       len(extra)) + name + extra


@dataclass(frozen=True)
class Record:
    """One zip record: its name, where its local header starts in the file, and its size."""

    name: bytes
    header_at: int
    size: int


def _central(rec: Record) -> bytes:
    extra_values: list[int] = []
    size_field = rec.size
    offset_field = rec.header_at
    if rec.size >= _ZIP64_LIMIT:
        extra_values += [rec.size, rec.size]
        size_field = 0xFFFFFFFF
    if rec.header_at >= _ZIP64_LIMIT:
        extra_values.append(rec.header_at)
        offset_field = 0xFFFFFFFF
    extra = struct.pack(f"<HH{len(extra_values)}Q", 1, 8 * len(extra_values), *extra_values) if extra_values else b""
    version = 45 if extra else 20
    return _CENTRAL.pack(0x02014B50, version, version, 0, 0, 0, _DOS_DATE, 0, size_field, size_field, len(rec.name),
                         len(extra), 0, 0, 0, 0, offset_field) + rec.name + extra


def zip_tail(records: list[Record], data_pkl: bytes, start: int, align: int) -> bytes:
    """The archive's last bytes from file offset ``start``: ``data.pkl`` and torch's small records,
    the central directory (``data.pkl`` first: torch takes the archive's name from the first
    entry) and the end records, padded with the end record's comment so the file ends on ``align``.
    """
    out = io.BytesIO()
    small = [(f"{ARCHIVE}/data.pkl".encode(), data_pkl), (f"{ARCHIVE}/.format_version".encode(), b"1"),
             (f"{ARCHIVE}/.storage_alignment".encode(), b"64"), (f"{ARCHIVE}/byteorder".encode(), b"little"),
             (f"{ARCHIVE}/version".encode(), b"3\n"),
             (f"{ARCHIVE}/.data/serialization_id".encode(), _serialization_id(data_pkl))]
    placed: list[Record] = []
    for name, data in small:
        placed.append(Record(name, start + out.tell(), len(data)))
        out.write(local_header(name, len(data)))
        out.write(data)
    entries = [placed[0], *records, *placed[1:]]
    cd_at = start + out.tell()
    for rec in entries:
        out.write(_central(rec))
    cd_size = start + out.tell() - cd_at
    count = len(entries)
    if count >= 0xFFFF or cd_at >= _ZIP64_LIMIT or cd_size >= _ZIP64_LIMIT:
        eocd64_at = start + out.tell()
        out.write(_EOCD64.pack(0x06064B50, _EOCD64.size - 12, 45, 45, 0, 0, count, count, cd_size, cd_at))
        out.write(_LOCATOR64.pack(0x07064B50, 0, eocd64_at, 1))
        count16, cd_size32, cd_at32 = 0xFFFF, min(cd_size, 0xFFFFFFFF), 0xFFFFFFFF
    else:
        count16, cd_size32, cd_at32 = count, cd_size, cd_at
    end = start + out.tell() + _EOCD.size
    comment = -end % align
    out.write(_EOCD.pack(0x06054B50, 0, 0, count16, count16, cd_size32, cd_at32, comment))
    out.write(b"\0" * comment)
    return out.getvalue()


def _serialization_id(data_pkl: bytes) -> bytes:
    """The 40-digit id torch.save gives an archive; ours is derived from its content, so equal states
    write equal bytes (the golden files)."""
    return str(int.from_bytes(hashlib.sha256(data_pkl).digest()[:16], "little")).zfill(40)[-40:].encode()


# ------------------------------------------------------------------ data.pkl


@dataclass(frozen=True)
class StorageRef:
    """A storage record, as ``data.pkl`` names it: ``('storage', <torch.XStorage>, key, 'cpu', numel)``."""

    key: str
    storage_type: Any
    numel: int


def storage_type(dtype: torch.dtype) -> Any | None:
    """The legacy storage class ``torch.save`` names for ``dtype`` (``torch.FloatStorage``), or ``None``."""
    name = torch.storage._dtype_to_storage_type_map().get(dtype)
    return None if name is None else getattr(torch, name, None)


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, tensors: dict[int, tuple[StorageRef, int, tuple[int, ...], tuple[int, ...]]]):
        super().__init__(file, protocol=PICKLE_PROTOCOL)
        self._tensors = tensors

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, StorageRef):
            return ("storage", obj.storage_type, obj.key, "cpu", obj.numel)
        return None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            placed = self._tensors.get(id(obj))
            if placed is not None:
                ref, offset, shape, stride = placed
                return torch._utils._rebuild_tensor_v2, (ref, offset, shape, stride, False, collections.OrderedDict())
        return NotImplemented


def split_shard(world_size: int) -> None:
    """What ``torch.load`` of rank 0's shard of a split checkpoint runs: an error saying how to load it."""
    raise PersistError(
        f"this file is rank 0's part of a checkpoint split across {world_size} ranks, not the whole state; "
        "load it with torch-persist: lightning_persist.load_from_checkpoint(ModelClass, path) for a "
        "LightningModule, or persist_core.CheckpointReader(<its local_dir>).load()")


class SplitShard:
    """Pickled as ``split_shard(world_size)``: the ``data.pkl`` of rank 0's shard when the ranks split a state."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return split_shard, (self.world_size,)


def incremental_checkpoint__load_with_lightning_persist_load_from_checkpoint(step: int, references: list[int]) -> None:
    """What ``torch.load`` of a referencing checkpoint's ``.ckpt`` runs (``weights_only=False``): an error saying how
    to load it. With ``weights_only=True`` (torch's default) torch refuses this global and its error shows the dotted
    name, which says the fix."""
    steps = f"step{'s' * (len(references) > 1)} {', '.join(map(str, references))}"
    raise PersistError(
        f"this file is incremental checkpoint step {step}'s: it holds only the tensors that changed and references "
        f"the bytes of the others in {steps} (torch-persist, incremental=True), so torch.load cannot read it "
        "whole; load it with torch-persist: lightning_persist.load_from_checkpoint(ModelClass, path) for a "
        "LightningModule (or persist_core.CheckpointReader(<its local_dir>).load(step)), or write one file torch.load "
        f"reads: persist export <its local_dir> --step {step} --to whole.ckpt")


class ReferencingShard:
    """Pickled as a call of :func:`incremental_checkpoint__load_with_lightning_persist_load_from_checkpoint`: the
    ``data.pkl`` of a torch-loadable shard compacted by an incremental save (it holds no tensors)."""

    def __init__(self, step: int, references: list[int]) -> None:
        self.step, self.references = step, references

    def __reduce__(self) -> tuple[Any, tuple[int, list[int]]]:
        return incremental_checkpoint__load_with_lightning_persist_load_from_checkpoint, (self.step, self.references)


def pickle_state(state: Any, tensors: dict[int, tuple[StorageRef, int, tuple[int, ...], tuple[int, ...]]]) -> bytes:
    """``state`` pickled as ``torch.save`` pickles it, each tensor (by ``id``) naming its storage record.

    Raises:
        pickle.PicklingError and friends: a leaf does not pickle (the planner already refused it).
    """
    out = io.BytesIO()
    _Pickler(out, tensors).dump(state)
    return out.getvalue()
