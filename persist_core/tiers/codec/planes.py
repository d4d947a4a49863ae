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


#: unsigned little-endian views of an element of each width (its bytes taken apart by shifts)
_UINT = {2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


def split_into(data: memoryview | bytes | np.ndarray, width: int, out: np.ndarray) -> np.ndarray:
    """``data`` as ``width`` byte planes (then its tail of ``len % width`` bytes), written into ``out`` (a ``uint8``
    array at least as long; the part it filled is returned). Numpy's loops, no Python copies: they release the GIL,
    so the codec's threads split blocks side by side."""
    src = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.view(np.uint8).ravel()
    out = out[: len(src)]
    n = len(src) // width * width if width > 1 else 0
    if n:
        planes = out[:n].reshape(width, -1)
        if width in (2, 4):  # byte k of each element is (element >> 8k), truncated to a byte: one pass per plane
            elements = src[:n].view(_UINT[width])
            np.copyto(planes[0], elements, casting="unsafe")
            for k in range(1, width):
                np.right_shift(elements, 8 * k, out=planes[k], casting="unsafe")
        else:
            np.copyto(planes, src[:n].reshape(-1, width).T)
    out[n:] = src[n:]
    return out


def join_into(data: memoryview | bytes | np.ndarray, width: int, out: np.ndarray) -> np.ndarray:
    """The inverse of :func:`split_into`: ``data`` (planes, then the tail) put back together into ``out`` (a
    ``uint8`` array of the same length)."""
    src = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.view(np.uint8).ravel()
    n = len(src) // width * width if width > 1 else 0
    if n:
        planes = src[:n].reshape(width, -1)
        if width == 2:  # element = plane0 | plane1 << 8
            elements = out[:n].view(_UINT[2])
            np.left_shift(planes[1], 8, out=elements, dtype=elements.dtype, casting="unsafe")
            np.bitwise_or(elements, planes[0], out=elements, casting="unsafe")
        else:  # byte k of every element from plane k: a strided copy per plane
            columns = out[:n].reshape(-1, width)
            for k in range(width):
                np.copyto(columns[:, k], planes[k])
    out[n : len(src)] = src[n:]
    return out


def split(data: memoryview | bytes, width: int) -> bytes:
    """``data`` as ``width`` byte planes (then its tail of ``len % width`` bytes)."""
    if width <= 1:
        return bytes(data)
    return split_into(data, width, np.empty(len(data), dtype=np.uint8)).tobytes()


def join(data: bytes, width: int) -> bytes:
    """The inverse of :func:`split`."""
    if width <= 1:
        return bytes(data)
    return join_into(data, width, np.empty(len(data), dtype=np.uint8)).tobytes()


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
