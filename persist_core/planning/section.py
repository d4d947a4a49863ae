"""Where each item's bytes go: the data section of one shard file, laid out item after item.

A :class:`DataSection` places :class:`~persist_core.planning.items.Item` s in file order, each on a
64-byte boundary, the gaps named ``__pad__.N`` entries (safetensors wants entries to tile the data),
and says what copies fill it (:class:`EntryCopy`); :meth:`DataSection.close` pads it to 4 KiB and
encodes the header. The torch-loadable layout (:mod:`persist_core.planning.torch_loadable`) places
its items with a zip local header at the end of the pad before each. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import repeat
from typing import Any, NamedTuple

import torch

from persist_core._knobs import ENTRY_ALIGN_BYTES, PAGE_BYTES
from persist_core.format.shard_file import FORMAT_NAME, FORMAT_VERSION, encode_header
from persist_core.planning.items import Item, Slot

_new = tuple.__new__  # a named tuple from its fields in order, without its __new__'s keyword handling


class EntryCopy(NamedTuple):
    """Copy ``source`` (viewed as ``dtype``/``shape``) into the data bytes ``[begin, end)``.

    A named tuple, not a frozen dataclass: a cached plan makes one per tensor every save (0.3 us, not 2)."""

    begin: int
    end: int
    source: torch.Tensor | bytes
    dtype: torch.dtype
    shape: tuple[int, ...]
    name: str = ""  # the shard entry it fills (for messages)


class DataSection:
    """One shard file's data section as it is laid out (offsets relative to its start).

    Attributes:
        entries: the safetensors header entries so far (``__metadata__`` first).
        copies: what fills the section, in file order; ``slots``: per copy, where its source is in a
            flattened state (``None``: bytes the plan made, a zip record's header).
        pos: the end of the section so far.
    """

    def __init__(self) -> None:
        self.entries: dict[str, Any] = {"__metadata__": {"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION)}}
        self.copies: list[EntryCopy] = []
        self.slots: list[Slot | None] = []
        self.pos = 0
        self._pads = 0

    def pad_to(self, align: int) -> None:
        """Pad the section to a multiple of ``align`` bytes (a ``__pad__.N`` entry; its bytes are zeros)."""
        gap = -self.pos % align
        if gap:
            self.entries[f"__pad__.{self._pads}"] = {"dtype": "U8", "shape": [gap], "data_offsets": [self.pos, self.pos + gap]}
            self._pads += 1
            self.pos += gap

    def place(self, items: Iterable[Item], local_headers: Iterable[bytes] | None = None) -> list[int]:
        """Place ``items`` in order, each on the next 64-byte boundary; return where each one's bytes start.

        ``local_headers`` (one per item, ``b""`` for none): a zip record's local header, placed at the end
        of the pad before its item, which pushes the item to the next boundary past it when the pad is
        too short to hold it. One loop over every item (a plan has one per storage: thousands).
        """
        entries, copies, slots, pos, pads = self.entries, self.copies, self.slots, self.pos, self._pads
        starts = []
        for (name, dtype, shape, nbytes, source, view, view_shape, slot, _), header in zip(items,
                                                                                      local_headers or repeat(b"")):
            start = pos + len(header)
            start += -start % ENTRY_ALIGN_BYTES
            if start != pos:
                entries[f"__pad__.{pads}"] = {"dtype": "U8", "shape": [start - pos], "data_offsets": [pos, start]}
                pads += 1
                if header:
                    copies.append(_new(EntryCopy, (pos, start, bytes(start - pos - len(header)) + header, torch.uint8,
                                                   (start - pos,), "")))
                    slots.append(None)
            pos = start + nbytes
            entries[name] = {"dtype": dtype, "shape": shape, "data_offsets": [start, pos]}
            if nbytes:
                copies.append(_new(EntryCopy, (start, pos, source, view, view_shape, name)))
                slots.append(slot)
            starts.append(start)
        self.pos, self._pads = pos, pads
        return starts

    def header_with(self, name: str, nbytes: int) -> bytes:
        """The header the section would have with an entry ``name`` of ``nbytes`` bytes at its end (unaligned)."""
        return encode_header({**self.entries, name: {"dtype": "U8", "shape": [nbytes],
                                                      "data_offsets": [self.pos, self.pos + nbytes]}})

    def append(self, name: str, blob: bytes) -> None:
        """Place the bytes ``blob`` right at the end as the entry ``name`` (unaligned: :meth:`header_with`)."""
        self.entries[name] = {"dtype": "U8", "shape": [len(blob)], "data_offsets": [self.pos, self.pos + len(blob)]}
        self.copies.append(EntryCopy(self.pos, self.pos + len(blob), blob, torch.uint8, (len(blob),)))
        self.slots.append(None)
        self.pos += len(blob)

    def close(self) -> bytes:
        """Pad the section to 4 KiB and return the file's header (safetensors: it ends on 4 KiB too)."""
        self.pad_to(PAGE_BYTES)
        return encode_header(self.entries)
