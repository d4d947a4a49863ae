"""What leaves the machine, at the link's rate and checked by the store (issue 56, items 4 and 5), without a server:
``remote_concurrency`` (one option, every entry point), how files are split among the connections, the composite
CRC32 S3 computes, and ``persist verify --remote`` on a store that records no checksum (fsspec's memory://)."""

from __future__ import annotations

import base64
import inspect
import json
import uuid
import zlib

import pytest
import torch
from click.testing import CliRunner

from persist_core import CheckpointEngine
from persist_core._link_knobs import MIN_SPLIT_BYTES, remote_span_bytes
from persist_core.cli import main
from persist_core.config import Config
from persist_core.errors import ConfigError
from persist_core.tiers.store_checksums import NOT_RECORDED, crc32_of

MiB = 1 << 20


def test_remote_concurrency_is_one_option_every_entry_point_shows_and_the_remote_tier_uses(tmp_path, monkeypatch):
    from accelerate_persist import PersistHook
    from lightning_persist import PersistCheckpointIO

    entries = [CheckpointEngine, PersistCheckpointIO, PersistHook]
    try:  # the HF Trainer's callback, where transformers is installed
        from accelerate_persist import PersistTrainerCallback
        entries.append(PersistTrainerCallback)
    except ImportError:
        pass
    for entry in entries:
        parameter = inspect.signature(entry).parameters["remote_concurrency"]
        assert parameter.kind is inspect.Parameter.KEYWORD_ONLY and parameter.default is None
    monkeypatch.setenv("PERSIST_REMOTE_CONCURRENCY", "5")
    assert Config(local_dir=tmp_path).remote_concurrency == 5  # None: the environment's, else 8
    url = f"memory:///link-{uuid.uuid4().hex[:8]}"
    with CheckpointEngine(tmp_path / "a", remote_url=url, remote_concurrency=24) as engine:
        assert engine.config.remote_concurrency == 24
        engine.save({"w": torch.ones(4)}, step=1).wait_remote()
        assert engine.reader._tier.concurrency == 24  # the tier the uploads and the restores use


@pytest.mark.parametrize("value", [0, -1, True, 2.5, "8", 513])
def test_a_bad_remote_concurrency_is_named_with_the_guidance(tmp_path, value):
    with pytest.raises(ConfigError, match=r"remote_concurrency=.* must be an int from 1 to 512.*85-90 MB/s"):
        CheckpointEngine(tmp_path / "a", remote_concurrency=value)


@pytest.mark.parametrize(("size", "concurrency", "most", "expected"), [
    (1 << 30, 8, 64 * MiB, 64 * MiB),     # large: the most per request, the connections all busy anyway
    (256 * MiB, 8, 64 * MiB, 32 * MiB),   # 4 reads of 64 MiB left 4 of 8 connections idle
    (256 * MiB, 16, 64 * MiB, 16 * MiB),  # a faster link, more connections: smaller pieces
    (20 * MiB, 8, 64 * MiB, MIN_SPLIT_BYTES),  # never smaller than 8 MiB: requests would eat the link
    (100 * MiB + 1, 4, 64 * MiB, 26 * MiB),    # rounded up to whole MiB
    (256 * MiB, 8, 16 * MiB, 16 * MiB),   # upload parts: PERSIST_REMOTE_PART_BYTES at most
])
def test_a_file_is_split_so_that_every_connection_has_a_request(size, concurrency, most, expected):
    assert remote_span_bytes(size, concurrency, most) == expected


def test_crc32_whole_and_composite_as_s3_computes_them():
    data = bytes(range(256)) * 50_000  # 12.8 MB
    whole = zlib.crc32(data).to_bytes(4, "big")
    assert crc32_of(data) == base64.b64encode(whole).decode()
    part = 5 * MiB
    inner = b"".join(zlib.crc32(data[i : i + part]).to_bytes(4, "big") for i in range(0, len(data), part))
    assert crc32_of(data, part) == base64.b64encode(zlib.crc32(inner).to_bytes(4, "big")).decode()
    assert crc32_of(data, part) != crc32_of(data)


def test_verify_remote_on_a_store_that_records_no_checksum_says_so_and_fails_nothing(tmp_path):
    url = f"memory:///link-{uuid.uuid4().hex[:8]}"
    with CheckpointEngine(tmp_path / "a", remote_url=url) as engine:
        engine.save({"w": torch.ones(4)}, step=3).wait_remote()
    done = CliRunner().invoke(main, ["verify", url, "--remote"], catch_exceptions=False)
    assert done.exit_code == 0, done.output
    assert f"step 3: {NOT_RECORDED}" in done.output
    report = json.loads(CliRunner().invoke(main, ["verify", url, "--remote", "--json"]).stdout)
    assert report["checkpoints"] == [{"step": 3, "ok": True, "objects": 0, "problems": [], "note": NOT_RECORDED}]
    local = CliRunner().invoke(main, ["verify", str(tmp_path / "a"), "--remote"])
    assert local.exit_code == 2 and "pass the remote URL" in local.output


WAS = {"size": 10, "etag": '"e1"', "algorithm": "CRC32", "checksum": "AAAAAA==", "type": "FULL_OBJECT"}


@pytest.mark.parametrize(("now", "says"), [
    (dict(WAS), None),
    (None, "missing; it was uploaded with 10 bytes"),
    ({**WAS, "checksum": "BBBBBB==", "etag": '"e2"'}, "CRC32 checksum is 'BBBBBB==' (CRC32), it was 'AAAAAA=='"),
    ({**WAS, "algorithm": "CRC64NVME", "checksum": "CCCCCCCCCCC=", "etag": '"e2"'}, "(CRC64NVME), it was"),
    ({"size": 10, "etag": '"e2"'}, "ETag is \"e2\", it was \"e1\""),  # no checksum now (SSE-KMS): the ETag decides
    ({"size": 10, "etag": '"e1"'}, None),
    ({**WAS, "size": 11}, "11 bytes, it was 10 at upload"),
])
def test_what_differs_from_the_stores_answer_at_upload(now, says):
    from persist_core.tiers.store_checksums import _differs

    found = _differs("s3://b/run/step-1/rank-0.safetensors", WAS, now)
    assert (found is None) if says is None else (says in found and found.startswith("s3://b/run/step-1/rank-0"))
