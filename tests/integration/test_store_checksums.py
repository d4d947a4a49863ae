"""The store's checksum of each uploaded object, recorded at upload and compared by ``persist verify --remote``:
the moto server over HTTP, through s3fs and botocore, as a user reaches S3.

moto accepts an upload whose checksum does not match its bytes (S3 refuses it: ``BadDigest``), so that S3 checks
what it receives is its documented contract (docs/remote.md), not something these tests can show; what they show is
what torch-persist does with the value the store reports.
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from persist_core import CheckpointEngine
from persist_core.cli import main
from persist_core.layout import STORE_CHECKSUMS_NAME, checkpoint_dirname
from persist_core.tiers.store_checksums import crc32_of
from tests.support import states
from tests.support.moto_server import FaultyProxy


def state_for(step: int, n: int) -> dict:
    return states.state_for(step, (n, n), random=True, bias=torch.float32)


class CountingProxy(FaultyProxy):
    """A loopback proxy to the moto server that keeps what every client sent (request lines: what was asked)."""

    def __init__(self, target_port: int) -> None:
        self.streams: list[bytearray] = []
        super().__init__(target_port)

    def _pump(self, src: socket.socket, dst: socket.socket, reset_at: int | None, upstream: bool) -> None:
        if upstream:
            sent = bytearray()
            self.streams.append(sent)
            src = _Tap(src, sent)  # type: ignore[assignment]
        super()._pump(src, dst, reset_at, upstream)

    def requests(self) -> list[tuple[str, str]]:
        """``(method, path)`` of every request so far (read while no upload runs: no request body in between)."""
        return [(m.decode(), p.decode()) for s in self.streams
                for m, p in re.findall(rb"(?m)^(GET|HEAD|PUT|POST|DELETE) (\S+) HTTP/1\.1\r$", bytes(s))]


class _Tap:
    def __init__(self, sock: socket.socket, into: bytearray) -> None:
        self._sock, self._into = sock, into

    def recv(self, n: int) -> bytes:
        data = self._sock.recv(n)
        self._into += data
        return data

    def __getattr__(self, name: str):
        return getattr(self._sock, name)


@pytest.fixture
def saved(tmp_path, bucket, s3_options, monkeypatch) -> tuple[str, Path]:
    """Step 1 (one PUT) and step 2 (a multipart upload in 5 MiB parts) uploaded: the URL and local_dir."""
    monkeypatch.setenv("PERSIST_REMOTE_PART_BYTES", str(5 << 20))
    url = f"s3://{bucket}/run"
    with CheckpointEngine(tmp_path / "nvme", remote_url=url, storage_options=s3_options) as engine:
        engine.save(state_for(1, 256), step=1).wait_remote()   # 0.26 MB
        engine.save(state_for(2, 1200), step=2).wait_remote()  # 5.8 MB: two parts
    return url, tmp_path / "nvme"


def _record(fs, url: str, step: int) -> dict:
    return json.loads(fs.cat_file(f"{url}/{checkpoint_dirname(step)}/{STORE_CHECKSUMS_NAME}"))["objects"]


def test_the_record_holds_the_crc32_the_store_computed_whole_or_per_part(saved, s3_options):
    import s3fs

    url, local = saved
    fs = s3fs.S3FileSystem(**s3_options, skip_instance_cache=True)
    (one,) = _record(fs, url, 1).items()
    name, stored = one
    data = (local / checkpoint_dirname(1) / name).read_bytes()
    assert stored["algorithm"] == "CRC32" and stored["type"] == "FULL_OBJECT" and stored["size"] == len(data)
    assert stored["checksum"] == crc32_of(data)
    (two,) = _record(fs, url, 2).items()
    name, stored = two
    data = (local / checkpoint_dirname(2) / name).read_bytes()
    assert stored["type"] == "COMPOSITE" and stored["part_bytes"] == 5 << 20 and stored["parts"] == 2
    assert stored["checksum"].split("-")[0] == crc32_of(data, stored["part_bytes"])  # S3 may add "-<parts>"
    assert stored["checksum"].split("-")[0] != crc32_of(data)


def test_verify_remote_compares_by_head_requests_and_names_an_object_replaced_out_of_band(saved, s3_endpoint):
    import boto3

    url, local = saved
    proxy = CountingProxy(int(s3_endpoint.rsplit(":", 1)[1]))
    options = json.dumps({"client_kwargs": {"endpoint_url": proxy.url}})
    try:
        done = CliRunner().invoke(main, ["--storage-options", options, "verify", url, "--remote"],
                                  catch_exceptions=False)
        assert done.exit_code == 0, done.output
        assert "step 1: OK (1 objects" in done.output and "step 2: OK (1 objects" in done.output
        asked = proxy.requests()
        assert not [p for m, p in asked if m == "GET" and ".safetensors" in p]  # no shard byte downloaded
        assert len([p for m, p in asked if m == "GET" and STORE_CHECKSUMS_NAME in p]) == 2  # (the tap sees GETs)
        assert len([p for m, p in asked if m == "HEAD" and ".safetensors" in p]) == 2

        # another writer replaces step 2's shard: the same size, other bytes (S3 checks and keeps their new checksum)
        bucket, prefix = url.removeprefix("s3://").split("/", 1)
        (shard,) = (local / checkpoint_dirname(2)).glob("*.safetensors")
        key = f"{prefix}/{checkpoint_dirname(2)}/{shard.name}"
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0xFF
        boto3.client("s3", endpoint_url=s3_endpoint).put_object(Bucket=bucket, Key=key, Body=bytes(data))

        done = CliRunner().invoke(main, ["--storage-options", options, "verify", url, "--remote", "--json"],
                                  catch_exceptions=False)
        assert done.exit_code == 1
        report = json.loads(done.stdout)
        assert [c["ok"] for c in report["checkpoints"]] == [True, False]
        (problem,) = report["checkpoints"][1]["problems"]
        assert f"{url}/{checkpoint_dirname(2)}/{shard.name}" in problem and "CRC32" in problem
        assert not [p for m, p in proxy.requests() if m == "GET" and ".safetensors" in p]
    finally:
        proxy.close()


def test_a_checkpoint_uploaded_without_a_record_is_said_so_not_failed(saved, s3_options):
    import s3fs

    url, _ = saved
    fs = s3fs.S3FileSystem(**s3_options, skip_instance_cache=True)
    fs.rm_file(f"{url}/{checkpoint_dirname(1)}/{STORE_CHECKSUMS_NAME}")
    done = CliRunner().invoke(main, ["--storage-options", json.dumps(s3_options), "verify", url, "--remote"],
                              catch_exceptions=False)
    assert done.exit_code == 0, done.output
    assert "step 1: no record of the store's checksums" in done.output and "step 2: OK" in done.output
