"""Staging buffers from an allocator (issue 41's seam for the memory tier): mapped from files, what a save
stages is in the file, and a file system too small for a buffer is a clear error, not a SIGBUS."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from persist_core.errors import ConfigError
from persist_core.staging.allocators import FileAllocator, HostAllocator
from persist_core.staging.pool import StagingBuffer, StagingPool


def test_a_buffer_mapped_from_a_file_holds_what_is_written_into_it(tmp_path):
    allocator = FileAllocator(tmp_path / "slots")
    buf = StagingBuffer(3 * 4096, allocator=allocator)
    assert buf.tensor.data_ptr() % 4096 == 0 and not buf.pinned
    buf.tensor[:5] = torch.tensor([1, 2, 3, 4, 5], dtype=torch.uint8)
    buf.memoryview(3 * 4096)[-1] = 7
    (path,) = allocator.paths
    assert path.read_bytes()[:5] == bytes([1, 2, 3, 4, 5]) and path.read_bytes()[-1] == 7
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and os.stat(path).st_size == 3 * 4096


def test_a_pool_hands_out_buffers_from_its_allocator(tmp_path):
    allocator = FileAllocator(tmp_path / "slots")
    pool = StagingPool(2, pin=False, allocator=allocator)
    buf, _ = pool.acquire(8192)
    assert buf.capacity >= 8192 and len(allocator.paths) >= 1
    pool.close()
    assert HostAllocator(pin=False).allocate(4096).data_ptr() % 4096 == 0


def test_a_file_where_one_is_planted_is_never_followed(tmp_path):
    slots = tmp_path / "slots"
    slots.mkdir()
    (slots / "slot-0").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(FileExistsError):
        FileAllocator(slots).allocate(4096)
    assert not (tmp_path / "elsewhere").exists()


def test_no_room_is_a_config_error_naming_the_directory(tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(ConfigError, match="cannot reserve 4096 bytes .* in .*slots"):
        FileAllocator(tmp_path / "slots").allocate(4096)
    assert list((tmp_path / "slots").iterdir()) == []
