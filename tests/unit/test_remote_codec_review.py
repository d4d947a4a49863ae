"""What leaves the machine (issue 56), tried as a new user would: what stays in the clear on an encrypted remote,
every byte of the envelope covered (with a key or without), a lease that does not authenticate, the key's own errors,
a missing codec package on the read side, and the ``persist`` commands that read an encrypted remote without its key.
fsspec's memory file system; the CLI in-process."""

from __future__ import annotations

import copy
from datetime import datetime, timedelta, timezone
import logging
import sys

import fsspec
import pytest
import torch
from click.testing import CliRunner

from persist_core import CheckpointEngine, CheckpointReader
from persist_core.cli import main
from persist_core.errors import ConfigError
from persist_core.tiers.codec import Codec, SecretKey
from persist_core.tiers.remote import RemoteTier
from tests.support.states import assert_state_equal

KEY = bytes(range(7, 39))
RUN = "RUN-ID-MUST-NOT-LEAK-4711"
CHUNK = 32 << 10


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"secret_layer_name.weight": (torch.randn(128, 128, generator=g) * 0.02).to(torch.bfloat16)},
            "optim": {"exp_avg": torch.randn(64, 128, generator=g)}, "step": 987654320 + step}


def _save(tmp_path, url, steps=(1, 2), **options):
    with CheckpointEngine(tmp_path / "a", remote_url=url, chunk_bytes=CHUNK, direct_io="off", run_id=RUN,
                          **options) as engine:
        for step in steps:
            engine.save(_state(step), step=step, metadata={"note": "USER-METADATA-SECRET"})
        engine.wait()


def _objects(url: str) -> dict[str, bytes]:
    fs, root = fsspec.core.url_to_fs(url)
    return {p: fs.cat_file(p) for p in fs.find(root)}


def test_an_encrypted_remote_holds_no_plaintext_of_the_state_its_lineage_or_metadata(tmp_path, memory_url):
    with CheckpointEngine(tmp_path / "a", remote_url=memory_url, chunk_bytes=CHUNK, direct_io="off", run_id=RUN,
                          remote_compression="zstd", remote_encryption_key=KEY) as engine:
        for step in (1, 2, 3):
            engine.save(_state(step), step=step, metadata={"note": "USER-METADATA-SECRET"})
        engine.wait()
        stored = _objects(memory_url)  # the lease too, while the run holds it
        engine.load(step=1)
        engine.save(_state(2), step=2)  # a branch: steps 2 and 3 set aside
        engine.wait()
        stored.update(_objects(memory_url))
    assert any(".lease.json" in p for p in stored) and any("abandoned" in p for p in stored)
    version = torch.__version__.encode()
    for needle in (b"secret_layer_name", b"exp_avg", RUN.encode(), b"USER-METADATA-SECRET", b"98765432", version,
                   b"lineage", b"git_commit"):
        assert not [p for p, b in stored.items() if needle in b], needle


@pytest.mark.parametrize("options", [{"remote_compression": "zstd"}, {"remote_encryption_key": KEY}],
                         ids=["zstd", "aes"])
def test_a_flipped_byte_anywhere_in_the_envelope_header_is_refused(tmp_path, memory_url, options):
    _save(tmp_path, memory_url, **options)
    fs, root = fsspec.core.url_to_fs(memory_url)
    path = f"{root}/step-{2:012d}/manifest.json"
    raw = fs.cat_file(path)
    head_end = raw.index(b"}") + 1  # the header's JSON object ends at its first "}" (a flat object)
    key = options.get("remote_encryption_key")
    tier = RemoteTier(memory_url, codec=Codec(None, key and SecretKey(key)))
    for at in range(len(b"torch-persist envelope 1\n") + 4, head_end):
        flipped = bytearray(raw)
        flipped[at] ^= 0x01
        fs.pipe_file(path, bytes(flipped))
        assert [i.step for i in tier.list()] == [1], (at, bytes(flipped[at - 8: at + 8]))
    fs.pipe_file(path, raw)
    with CheckpointReader(tmp_path / "fresh", remote_url=memory_url, remote_encryption_key=key) as reader:
        assert_state_equal(reader.load(), _state(2))


def test_a_lease_that_does_not_authenticate_is_taken_over_not_a_stop_to_every_upload(tmp_path, memory_url, caplog):
    _save(tmp_path, memory_url, steps=(1,), remote_encryption_key=KEY)
    fs, root = fsspec.core.url_to_fs(memory_url)
    fs.pipe_file(f"{root}/.lease.json", b"torch-persist record 1\n" + bytes(64))  # damaged, or another key's
    fs.store[f"{root}/.lease.json"].created = datetime.now(timezone.utc) - timedelta(hours=1)  # and not renewed since
    with caplog.at_level(logging.WARNING), CheckpointEngine(tmp_path / "b", remote_url=memory_url, direct_io="off",
                                                            remote_encryption_key=KEY) as engine:
        engine.load()
        engine.save(_state(2), step=2).wait_remote()
    assert [i.step for i in RemoteTier(memory_url, codec=Codec(None, SecretKey(KEY))).list()] == [1, 2]
    assert "lease" in caplog.text and "authenticate" in caplog.text


def test_a_live_lease_sealed_under_another_key_refuses_the_writer_naming_the_key(tmp_path, memory_url):
    from persist_core.errors import DirectoryInUseError
    from persist_core.sync.lease import RemoteLease

    holder = RemoteLease(RemoteTier(memory_url, codec=Codec(None, SecretKey(KEY))), "run-a", ttl_s=600)
    holder.ensure()
    other = RemoteLease(RemoteTier(memory_url, codec=Codec(None, SecretKey(bytes(32)))), "run-b", ttl_s=600)
    with pytest.raises(DirectoryInUseError, match="cannot read with its remote_encryption_key"):
        other.ensure()
    holder.ensure()  # the holder goes on


@pytest.mark.parametrize("given,says", [(lambda: 1 / 0, "raised ZeroDivisionError"), (lambda: KEY.hex(), "str"),
                                        (lambda: KEY[:31], "31 bytes")])
def test_a_key_callable_that_fails_is_one_config_error_naming_the_option(tmp_path, memory_url, given, says):
    _save(tmp_path, memory_url, steps=(1,), remote_encryption_key=KEY)
    with CheckpointReader(tmp_path / "fresh", remote_url=memory_url, remote_encryption_key=given) as reader:
        with pytest.raises(ConfigError, match="remote_encryption_key") as e:
            reader.load()
    assert says in str(e.value) and KEY.hex() not in str(e.value)


def test_a_config_holding_key_bytes_copies_in_process(tmp_path, memory_url):
    from persist_core.config import Config

    config = Config(local_dir=tmp_path, remote_url=memory_url, remote_encryption_key=KEY)
    assert copy.deepcopy(config).remote_encryption_key.bytes() == KEY
    assert copy.copy(config) == config


def test_reading_a_compressed_remote_without_zstandard_is_a_config_error_not_corruption(tmp_path, memory_url,
                                                                                         monkeypatch):
    _save(tmp_path, memory_url, remote_compression="zstd")
    monkeypatch.setitem(sys.modules, "zstandard", None)  # import zstandard raises ImportError
    with CheckpointReader(tmp_path / "fresh", remote_url=memory_url) as reader:
        with pytest.raises(ConfigError, match=r"torch-persist\[compress\]"):
            reader.load()


# ---------------------------------------------------------------------------------------------- persist, no key

def _cli(*args: str, env: dict | None = None):
    return CliRunner(env=env).invoke(main, list(args))


def test_persist_verify_without_the_key_is_one_error_naming_it_not_bad_checkpoints(tmp_path, memory_url):
    _save(tmp_path, memory_url, remote_encryption_key=KEY)
    result = _cli("verify", memory_url)
    assert result.exit_code == 2, result.output
    assert "remote_encryption_key" in result.output and "BAD" not in result.output
    assert _cli("verify", memory_url, "--encryption-key-env", "K", env={"K": KEY.hex()}).exit_code == 0


@pytest.mark.parametrize("args", [("gc", "--keep-last", "1"), ("rm", "--step", "1"), ("stats",)])
def test_persist_commands_that_need_the_manifests_refuse_without_the_key_and_remove_nothing(tmp_path, memory_url,
                                                                                            args):
    _save(tmp_path, memory_url, steps=(1, 2, 3), remote_encryption_key=KEY)
    before = set(_objects(memory_url))
    result = _cli(args[0], memory_url, *args[1:])
    assert result.exit_code != 0 and "remote_encryption_key" in result.output, result.output
    assert set(_objects(memory_url)) == before


def test_encryption_key_env_of_the_wrong_length_is_a_usage_error_at_once(tmp_path, memory_url):
    result = _cli("ls", memory_url, "--encryption-key-env", "K", env={"K": "ab" * 16})
    assert result.exit_code == 2 and "--encryption-key-env K" in result.output and "32" in result.output
    assert "ab" * 16 not in result.output


def test_a_checkpoints_objects_copied_to_another_steps_prefix_are_refused(tmp_path, memory_url):
    _save(tmp_path, memory_url, remote_encryption_key=KEY)
    fs, root = fsspec.core.url_to_fs(memory_url)
    for p in fs.find(f"{root}/step-{1:012d}"):
        fs.pipe_file(p.replace(f"step-{1:012d}", f"step-{5:012d}"), fs.cat_file(p))
    with CheckpointReader(tmp_path / "fresh", remote_url=memory_url, remote_encryption_key=KEY) as reader:
        assert [c.step for c in reader.list("remote")] == [1, 2]
        assert_state_equal(reader.load(), _state(2))
