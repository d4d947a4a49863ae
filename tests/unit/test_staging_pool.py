"""The staging buffers' warm-up: after a load, the next save's buffer is allocated and its pages are in
memory before that save copies into it (the first copy into a fresh buffer also faults every page in)."""

from __future__ import annotations

import ctypes
import sys

import pytest
import torch

from persist_core import CheckpointEngine
from persist_core.hostmem import populate
from persist_core.staging.pool import StagingBuffer, StagingPool
from tests.support.states import assert_state_equal

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")

PAGE = 4096


def resident_fraction(buf: StagingBuffer) -> float:
    """The share of ``buf``'s pages in memory (``mincore``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pages = -(-buf.capacity // PAGE)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(buf.tensor.data_ptr()), ctypes.c_size_t(pages * PAGE), vec) == 0
    return sum(v & 1 for v in vec) / pages


def populate_works() -> bool:
    buf = StagingBuffer(PAGE * 4, pin=False)
    populate(buf.tensor.data_ptr(), buf.capacity, turn=lambda: None, stop=lambda: False)
    return resident_fraction(buf) == 1.0


needs_populate = pytest.mark.skipif(not populate_works(), reason="this kernel has no MADV_POPULATE_WRITE (< 5.14)")


def settle(engine: CheckpointEngine) -> None:
    """Wait for the engine's warm-up, if one runs."""
    warming = engine._parts.pool._warming
    if warming is not None:
        warming.join()


def state(n: int = 1 << 20) -> dict:
    torch.manual_seed(0)
    return {"w": torch.randn(n), "b": torch.randn(n // 4).double(), "step": 3}


@needs_populate
def test_warm_allocates_the_free_slot_with_its_pages_in_memory():
    pool = StagingPool(1, pin=False)
    pool.warm(8 << 20).join()
    buf, waited = pool.acquire(8 << 20)
    assert buf.capacity >= 8 << 20 and resident_fraction(buf) == 1.0
    assert pool.warm(8 << 20) is None  # nothing left to warm


def test_populating_leaves_the_bytes_alone():
    buf = StagingBuffer(3 << 20, pin=False)
    data = torch.randint(0, 255, (3 << 20,), dtype=torch.uint8)
    buf.tensor.copy_(data)
    populate(buf.tensor.data_ptr(), buf.capacity, turn=lambda: None, stop=lambda: False)  # a save may copy in meanwhile
    assert torch.equal(buf.tensor, data)


def test_no_warm_up_beyond_the_memory_available():
    pool = StagingPool(1, pin=False)
    assert pool.warm(1 << 50) is None  # 1 PiB: it would not fit; the first save allocates as before
    buf, _ = pool.acquire(1 << 20)
    assert buf.capacity == 1 << 20


@needs_populate
def test_after_a_load_the_next_save_copies_into_a_warm_buffer(ckpt_dir):
    with CheckpointEngine(ckpt_dir) as engine:
        engine.save(state(), step=1).wait()
    with CheckpointEngine(ckpt_dir) as engine:  # a restarted job
        loaded = engine.load()
        assert_state_equal(loaded, state())
        size = engine.list()[-1].nbytes
        settle(engine)
        buf, _ = engine._parts.pool.acquire(size)  # what the next save takes: allocated, its pages in
        assert buf.capacity >= size and resident_fraction(buf) == 1.0
        engine._parts.pool.release(buf)
        handle = engine.save(state(), step=2)
        handle.wait()
        assert handle.stats.nbytes <= buf.capacity
        assert_state_equal(engine.load(2), state())


@needs_populate
def test_a_load_through_the_engines_reader_warms_too(ckpt_dir):
    """The adapters load through ``engine.reader`` (Lightning's ``load_checkpoint``)."""
    with CheckpointEngine(ckpt_dir) as engine:
        engine.save(state(), step=1).wait()
    with CheckpointEngine(ckpt_dir) as engine:
        engine.reader.load(into={"w": torch.empty(1 << 20), "b": torch.empty(1 << 18, dtype=torch.float64)})
        settle(engine)
        buf, _ = engine._parts.pool.acquire(1)
        assert buf.capacity >= engine.list()[-1].nbytes and resident_fraction(buf) == 1.0
