"""assembly/plan.py, pure: a record's saved chunks (typed, as the reads plan them) and the bytes of each a box needs."""

from __future__ import annotations

import pytest

from persist_core.errors import CorruptCheckpointError
from persist_core.format.records import Chunk, TensorRecord
from persist_core.assembly.plan import SavedChunk, chunk_read, saved_chunks


def test_a_plain_record_is_one_chunk_the_whole_tensor_with_its_offset_and_stride():
    rec = TensorRecord(dtype="float32", shape=(10,), file="rank-00000.safetensors", entry="__shared__.1",
                       stride=(2,), offset=96)
    assert saved_chunks(rec) == [SavedChunk("rank-00000.safetensors", "__shared__.1", (0,), (10,), 96, (2,))]


def test_a_sharded_record_gives_its_chunks_c_contiguous_from_the_entry_start():
    chunks = (Chunk(file="rank-00000.safetensors", entry="w", offsets=(0, 0), sizes=(4, 5)),
              Chunk(file="rank-00001.safetensors", entry="w", offsets=(4, 0), sizes=(3, 5), step=3, hash="0" * 32))
    rec = TensorRecord(dtype="float32", shape=(7, 5), chunks=chunks)
    assert saved_chunks(rec) == [SavedChunk("rank-00000.safetensors", "w", (0, 0), (4, 5)),
                                 SavedChunk("rank-00001.safetensors", "w", (4, 0), (3, 5))]


@pytest.mark.parametrize("box, want", [
    (((0, 0), (7, 5)), ((4, 0), (3, 5), 0, 60, True)),  # the whole chunk
    (((5, 0), (2, 5)), ((5, 0), (2, 5), 20, 60, True)),  # its last two rows: one run
    (((4, 1), (2, 2)), ((4, 1), (2, 2), 4, 32, False)),  # two columns of two rows: the span, not in order
])
def test_a_box_reads_the_span_of_the_chunk_it_overlaps(box, want):
    c = SavedChunk("rank-00001.safetensors", "w", (4, 0), (3, 5))
    r = chunk_read(box, c, 2, 4, "w", "ckpt")
    assert (r.meet[0], r.meet[1], r.start, r.stop, r.in_order) == want and r.strides == (5, 1) and r.low == 0


def test_a_strided_chunk_reads_from_its_offset_and_a_box_outside_reads_nothing():
    c = SavedChunk("f", "__shared__.1", (0,), (10,), 96, (2,))
    r = chunk_read(((3,), (2,)), c, 1, 4, "v", "ckpt")
    assert (r.start, r.stop, r.strides, r.in_order, r.low) == (96 + 24, 96 + 36, (2,), False, 96)
    assert chunk_read(((10,), (1,)), SavedChunk("f", "w", (0,), (10,)), 1, 4, "w", "ckpt") is None


def test_a_chunk_with_another_number_of_dimensions_than_its_tensor_is_corrupt():
    with pytest.raises(CorruptCheckpointError, match="has 1 dimensions, the tensor 2"):
        chunk_read(((0, 0), (2, 2)), SavedChunk("f", "w", (0,), (4,)), 2, 4, "w", "ckpt")
