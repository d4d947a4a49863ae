"""The byte-plane transform of the remote codec (issue 56) keeps its stored format: numpy's in-place loops give the
same planes as the plain transpose the first stored blocks were written with, for every width and any tail, and
decoding into the memory that holds a block (whole, or across several views) gives its bytes back."""

from __future__ import annotations

import os

import numpy as np
import pytest

from persist_core.format.manifest import FileEntry
from persist_core.tiers.codec import Codec, SecretKey, block_aad, planes
from persist_core.tiers.codec import files as codec_files


def _transposed(data: bytes, width: int) -> bytes:
    """The planes as first defined: elements as rows, transposed, then the tail."""
    n = len(data) // width * width
    arr = np.frombuffer(data, dtype=np.uint8)
    return arr[:n].reshape(-1, width).T.tobytes() + data[n:]


@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 4096 + 3])
def test_planes_are_the_transpose_and_join_inverts_them(width, size):
    data = os.urandom(size)
    split = planes.split(data, width)
    assert split == _transposed(data, width)
    assert planes.join(split, width) == data


def test_blocks_decode_into_views_that_split_them_anywhere():
    data = (np.random.default_rng(0).standard_normal(40_000).astype(np.float32) * 0.02).tobytes()
    f = FileEntry(name="r0.safetensors", rank=0, size=len(data), checksum="", chunk_bytes=16_384,
                  chunks=(0,) * -(-len(data) // 16_384))
    codec = Codec("zstd", SecretKey(bytes(range(32))))
    stored = [codec.encode(data[i * f.chunk_bytes:(i + 1) * f.chunk_bytes], 4, block_aad("r", "s", f.name, i))
              for i in range(len(f.chunks))]
    out = bytearray(len(data) - f.chunk_bytes)  # blocks 1.. into three views, cut inside blocks and at their ends
    cuts = [0, 1000, 2 * f.chunk_bytes, len(out)]
    views = [memoryview(out)[a:b] for a, b in zip(cuts, cuts[1:])]
    codec_files.decode_into(codec, b"".join(stored[1:]), tuple(len(s) for s in stored), f, 1, len(f.chunks), views,
                            run="r", save="s", encrypted=True, where="test")
    assert bytes(out) == data[f.chunk_bytes:]
