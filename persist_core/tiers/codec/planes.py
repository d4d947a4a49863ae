"""The byte-plane transform (before compression): a block of floating-point elements of ``width`` bytes each is
rewritten as ``width`` planes, plane ``k`` holding byte ``k`` of every element. A float's exponent bytes repeat far
more than its mantissa bytes, so zstd finds them once they sit together (ZipNN's observation). Lossless for any
bytes: a block whose length is no multiple of ``width`` keeps its tail as is.

:func:`block_widths` picks each checksum block's width from the shard file's safetensors header (which floating
dtype covers most of the block's bytes); a file whose header does not parse (a torch-loadable zip shard) gets width
1 (zstd alone) everywhere.
"""

from __future__ import annotations

import json
import struct

import numpy as np

#: the floating dtypes (safetensors names) whose elements are split into planes, and their widths
_FLOAT_WIDTHS = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8}


def split(data: memoryview | bytes, width: int) -> bytes:
    """``data`` as ``width`` byte planes (then its tail of ``len % width`` bytes)."""
    if width <= 1:
        return bytes(data)
    n = len(data) // width * width
    arr = np.frombuffer(data, dtype=np.uint8)
    planes = arr[:n].reshape(-1, width).T.tobytes()
    return planes + bytes(arr[n:])


def join(data: bytes, width: int) -> bytes:
    """The inverse of :func:`split`."""
    if width <= 1:
        return data
    n = len(data) // width * width
    arr = np.frombuffer(data, dtype=np.uint8)
    return arr[:n].reshape(width, -1).T.tobytes() + bytes(arr[n:])


def block_widths(head: bytes, *, file_size: int, block_bytes: int) -> list[int]:
    """Per checksum block of a shard file (``head``: its first bytes, enough to hold the header), the width of the
    floating dtype covering most of the block (1 where none does, or the header does not parse)."""
    n_blocks = max(1, -(-file_size // block_bytes))
    widths = [1] * n_blocks
    try:
        (length,) = struct.unpack("<Q", head[:8])
        entries = json.loads(head[8 : 8 + length])
    except (struct.error, ValueError, UnicodeDecodeError):
        return widths
    if not isinstance(entries, dict):
        return widths
    covered: list[dict[int, int]] = [{} for _ in range(n_blocks)]
    base = 8 + length
    for entry in entries.values():
        if not isinstance(entry, dict):
            continue
        width = _FLOAT_WIDTHS.get(str(entry.get("dtype")))
        offsets = entry.get("data_offsets")
        if width is None or not isinstance(offsets, list) or len(offsets) != 2:
            continue
        start, end = base + int(offsets[0]), base + int(offsets[1])
        for i in range(start // block_bytes, min(n_blocks, -(-end // block_bytes))):
            lo, hi = max(start, i * block_bytes), min(end, (i + 1) * block_bytes)
            covered[i][width] = covered[i].get(width, 0) + max(0, hi - lo)
    return [max(c, key=c.__getitem__) if c else 1 for c in covered]
