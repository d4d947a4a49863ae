"""Issue 56 over HTTP: the moto S3 server through s3fs (multipart, ranged GETs). A run writes compressed and
encrypted checkpoints; a fresh machine restores them bit-exact; ``persist`` commands take the key from an environment
variable (``ls`` without it lists steps, sizes and "encrypted" only); no plaintext is stored; ``push`` writes the
same codec."""

from __future__ import annotations

import json

import fsspec
import pytest
import s3fs
import torch
from click.testing import CliRunner

from persist_core import CheckpointEngine, CheckpointReader
from persist_core.cli import main
from persist_core.errors import PersistError
from tests.support.states import assert_state_equal

pytestmark = pytest.mark.slow

KEY = bytes(range(100, 132))
MARK = b"PLAINTEXT-MARKER-s3-0123456789"


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": (torch.randn(512, 1024, generator=g) * 0.02).to(torch.bfloat16),
            "m": torch.randn(512, 512, generator=g) * 1e-3,
            "mark": torch.frombuffer(bytearray(MARK * 100), dtype=torch.uint8), "step": step}


def _stored(bucket: str, s3_endpoint: str) -> dict[str, bytes]:
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint}, skip_instance_cache=True)
    return {p: fs.cat_file(p) for p in fs.find(bucket)}


def _cli(*args: str, s3_options: dict, env: dict | None = None):
    return CliRunner(env=env).invoke(main, ["--storage-options", json.dumps(s3_options), *args],
                                     catch_exceptions=False)


def test_encrypted_compressed_run_restores_on_a_fresh_machine_and_the_cli_takes_the_key(
        tmp_path, bucket, s3_endpoint, s3_options, monkeypatch):
    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": s3_endpoint})
    url = f"s3://{bucket}/run"
    options = {"remote_url": url, "remote_compression": "zstd", "remote_encryption_key": KEY,
               "chunk_bytes": 256 << 10, "direct_io": "off"}
    with CheckpointEngine(tmp_path / "a", **options) as engine:
        for step in (1, 2):
            engine.save(_state(step), step=step)
        engine.wait()
    assert not any(MARK in b for b in _stored(bucket, s3_endpoint).values())
    with CheckpointEngine(tmp_path / "fresh", **options) as engine:
        assert_state_equal(engine.load(), _state(2))
    with CheckpointReader(tmp_path / "nokey", remote_url=url, storage_options=s3_options) as reader:
        with pytest.raises(PersistError, match="remote_encryption_key"):
            reader.load()

    env = {"TRAIN_KEY": KEY.hex()}
    rows = json.loads(_cli("ls", url, "--json", s3_options=s3_options).output)
    assert [(r["step"], r.get("encrypted"), r["files"], r["time"]) for r in rows] == [(1, True, None, None),
                                                                                      (2, True, None, None)]
    assert all(r["bytes"] > 0 for r in rows)
    rows = json.loads(_cli("ls", url, "--json", "--encryption-key-env", "TRAIN_KEY", s3_options=s3_options,
                           env=env).output)
    assert [(r["step"], r["files"]) for r in rows] == [(1, 1), (2, 1)]
    checked = _cli("verify", url, "--encryption-key-env", "TRAIN_KEY", s3_options=s3_options, env=env)
    assert checked.exit_code == 0 and checked.output.count(": OK") == 2, checked.output
    pulled = _cli("pull", url, str(tmp_path / "pulled"), "--step", "1", "--encryption-key-env", "TRAIN_KEY",
                  s3_options=s3_options, env=env)
    assert pulled.exit_code == 0, pulled.output
    assert_state_equal(CheckpointReader(tmp_path / "pulled").load(step=1), _state(1))
    refused = _cli("pull", url, str(tmp_path / "nokey2"), s3_options=s3_options)
    assert refused.exit_code != 0 and "remote_encryption_key" in refused.output

    pushed = _cli("push", str(tmp_path / "pulled"), f"s3://{bucket}/copy", "--compression", "zstd",
                  "--encryption-key-env", "TRAIN_KEY", s3_options=s3_options, env=env)
    assert pushed.exit_code == 0, pushed.output
    copy = {p: b for p, b in _stored(bucket, s3_endpoint).items() if "/copy/" in p}
    assert copy and not any(MARK in b for b in copy.values())
    with CheckpointReader(tmp_path / "fresh2", remote_url=f"s3://{bucket}/copy", storage_options=s3_options,
                          remote_encryption_key=lambda: KEY) as reader:
        assert_state_equal(reader.load(), _state(1))
