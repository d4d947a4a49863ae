"""Issue 56, the codec at the link's rate, over HTTP (moto through s3fs): an encoded file goes up block by block as
the codec makes them (the first part is sent while later blocks are still to be encoded, not after a whole encoded
copy is written), a part that fails on the wire is sent again with the same bytes, and the restore is bit-exact."""

from __future__ import annotations

import hashlib
import threading

import pytest
import torch

from persist_core import CheckpointEngine
from persist_core.tiers._s3 import S3Transfer
from persist_core.tiers.codec import Codec
from persist_core.tiers.codec.stored import Stored
from tests.support.states import assert_state_equal

pytestmark = pytest.mark.slow


def test_blocks_go_up_as_they_are_encoded_and_a_retried_part_resends_its_bytes(tmp_path, bucket, s3_options,
                                                                                monkeypatch):
    monkeypatch.setenv("PERSIST_REMOTE_PART_BYTES", str(5 << 20))
    monkeypatch.setenv("PERSIST_REMOTE_BACKOFF_MS", "1")
    g = torch.Generator().manual_seed(0)
    state = {"w": (torch.randn(4 << 20, generator=g) * 0.02).to(torch.bfloat16),  # 8 MiB
             "m": torch.randn(2 << 20, generator=g) * 1e-3}  # 8 MiB
    last: list[int] = []  # the index of the file's last block (the file's checksum blocks, as the manifest says)
    first_part_sent = threading.Event()
    last_waited: list[bool] = []
    sends: list[tuple[int, str]] = []

    encode = Codec.encode

    def slow_last(self, data, width, aad):  # the last block waits (bounded) for part 1 to be on its way
        if int(aad.rsplit(b"\x00", 1)[1]) == last[0]:
            last_waited.append(first_part_sent.wait(timeout=60))
        return encode(self, data, width, aad)

    blocks = Stored.blocks

    def blocks_of(self, local_ckpt, step, f):
        last[:] = [len(f.chunks) - 1]
        return blocks(self, local_ckpt, step, f)

    upload_part = S3Transfer.upload_part

    def flaky(self, bucket_, key, upload, number, body, *, retry, path):
        def once():
            sends.append((number, hashlib.sha256(body).hexdigest()))
            first_part_sent.set()
            if number == 1 and [n for n, _ in sends].count(1) == 1:  # parts go up concurrently: part 1's first send
                raise ConnectionResetError(104, "reset by peer")  # transient: retried
        retry("test", once)
        return upload_part(self, bucket_, key, upload, number, body, retry=retry, path=path)

    monkeypatch.setattr(Codec, "encode", slow_last)
    monkeypatch.setattr(Stored, "blocks", blocks_of)
    monkeypatch.setattr(S3Transfer, "upload_part", flaky)
    options = {"remote_url": f"s3://{bucket}/run", "storage_options": s3_options, "remote_compression": "zstd",
               "remote_encryption_key": bytes(32), "chunk_bytes": 1 << 20, "direct_io": "off"}
    with CheckpointEngine(tmp_path / "a", **options) as engine:
        engine.save(state, step=1).wait_remote()
    assert last_waited == [True]  # a part went up before the last block was encoded
    first = [digest for n, digest in sends if n == 1]
    assert len(first) == 2 and first[0] == first[1]  # part 1 reset, then the same bytes again
    assert len({n for n, _ in sends}) >= 2  # a multipart upload
    with CheckpointEngine(tmp_path / "fresh", **options) as engine:
        assert_state_equal(engine.load(), state)
