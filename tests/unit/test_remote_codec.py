"""What leaves the machine (issue 56) on fsspec's memory file system: the remote's blocks compressed (byte planes,
zstd) and encrypted (AES-256-GCM, authenticated by an identity a set-aside keeps), the logical manifest the same on
both tiers; a fresh machine restores bit-exact; a ranged load reads only its blocks; no plaintext leaves; a flipped
byte, a swapped block, a replayed abandoned checkpoint, a wrong or missing key are refused."""

from __future__ import annotations

import builtins
import os
import pickle

import fsspec
import pytest
import torch

from persist_core import CheckpointEngine, CheckpointReader
from persist_core.errors import ConfigError, CorruptCheckpointError, PersistError
from persist_core.format.manifest import Manifest
from persist_core.tiers.codec import Codec, SecretKey
from persist_core.tiers.remote import RemoteTier
from tests.support.states import assert_state_equal

KEY = bytes(range(32))
MARK = b"PLAINTEXT-MARKER-0123456789abcdef"  # a byte pattern of the state: must not appear on the remote with a key
CHUNK = 64 << 10  # small checksum blocks: several per tensor


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    w = (torch.randn(256, 512, generator=g) * 0.02).to(torch.bfloat16)
    m = torch.randn(256, 512, generator=g) * 1e-3
    return {"model": {"w": w, "b": torch.randn(512, generator=g)},
            "optim": {"exp_avg": m, "exp_avg_sq": m * m, "mark": torch.frombuffer(bytearray(MARK * 64), dtype=torch.uint8)},
            "step": step}


def _objects(url: str) -> dict[str, bytes]:
    fs, root = fsspec.core.url_to_fs(url)
    return {p: fs.cat_file(p) for p in fs.find(root)}


def _save(tmp_path, url, steps=(1,), **options):
    with CheckpointEngine(tmp_path / "a", remote_url=url, chunk_bytes=CHUNK, direct_io="off", **options) as engine:
        for step in steps:
            engine.save(_state(step), step=step)
        engine.wait()


@pytest.mark.parametrize("options", [{"remote_compression": "zstd"}, {"remote_encryption_key": KEY},
                                     {"remote_compression": "zstd", "remote_encryption_key": lambda: KEY}],
                         ids=["zstd", "aes", "zstd+aes"])
def test_a_fresh_machine_restores_bit_exact_and_the_manifest_is_the_same_on_both_tiers(tmp_path, memory_url, options):
    _save(tmp_path, memory_url, steps=(1, 2), **options)
    key = options.get("remote_encryption_key")
    with CheckpointEngine(tmp_path / "fresh", remote_url=memory_url, **options) as engine:
        assert_state_equal(engine.load(), _state(2))
        assert engine.load(step=1)["step"] == 1
    with CheckpointReader(tmp_path / "fresh2", remote_url=memory_url, remote_encryption_key=key) as reader:
        assert_state_equal(reader.load(step=1), _state(1))
        remote = reader._tier.read_manifest(2)
    local = Manifest.from_bytes((tmp_path / "a" / f"step-{2:012d}" / "manifest.json").read_bytes(), where="local")
    assert remote == local
    stored = sum(len(b) for p, b in _objects(memory_url).items() if p.endswith(".safetensors"))
    if "remote_compression" in options:  # (the bar, 0.85x on a trained state, is benchmarks/bench_codec.py's)
        assert stored < 0.95 * 2 * local.nbytes
    if key is not None:
        assert not any(MARK in b for b in _objects(memory_url).values())


def test_without_a_codec_the_mark_is_there(tmp_path, memory_url):  # the search above can find it
    _save(tmp_path, memory_url)
    assert any(MARK in b for b in _objects(memory_url).values())


def test_a_ranged_read_reads_only_its_blocks(tmp_path, memory_url):
    _save(tmp_path, memory_url, remote_compression="zstd", remote_encryption_key=KEY)
    reads: list[tuple[int, int]] = []
    tier = RemoteTier(memory_url, codec=Codec(None, SecretKey(KEY)))
    real = tier._read_range
    tier._read_range = lambda path, start, end: reads.append((start, end)) or real(path, start, end)
    f = tier.read_manifest(1).files[0]
    lengths = tier.stored.envelope(1).layout[f.name]
    local = (tmp_path / "a" / f"step-{1:012d}" / f.name).read_bytes()
    views = [memoryview(bytearray(CHUNK)) for _ in range(2)]
    tier.read_blocks(1, f, 3, views)  # blocks 3 and 4: what a ranged or resharded load asks for
    assert b"".join(views) == local[3 * CHUNK : 5 * CHUNK]
    assert reads == [(sum(lengths[:3]), sum(lengths[:5]))]
    reads.clear()
    assert tier.read_range(1, f, 5 * CHUNK + 10, 6 * CHUNK + 20) == local[5 * CHUNK + 10 : 6 * CHUNK + 20]
    assert reads == [(sum(lengths[:5]), sum(lengths[:7]))]


def _flip(url: str, name_ends: str, at: int = -40) -> None:
    fs, root = fsspec.core.url_to_fs(url)
    path = next(p for p in fs.find(root) if p.endswith(name_ends))
    raw = bytearray(fs.cat_file(path))
    raw[at] ^= 0x01
    fs.pipe_file(path, bytes(raw))


@pytest.mark.parametrize("options", [{"remote_compression": "zstd"}, {"remote_encryption_key": KEY}],
                         ids=["zstd", "aes"])
@pytest.mark.parametrize("target", ["shard", "manifest"])
def test_a_flipped_byte_in_a_remote_object_is_never_loaded(tmp_path, memory_url, options, target):
    _save(tmp_path, memory_url, steps=(1, 2), **options)
    _flip(memory_url, f"step-{2:012d}/" + ("manifest.json" if target == "manifest" else "rank-00000.safetensors"))
    key = options.get("remote_encryption_key")
    with CheckpointReader(tmp_path / "fresh", remote_url=memory_url, remote_encryption_key=key) as reader:
        if target == "manifest":  # that checkpoint is skipped: the newest that verifies is loaded
            assert_state_equal(reader.load(), _state(1))
        else:
            with pytest.raises(CorruptCheckpointError):
                reader.load(step=2)
    assert RemoteTier(memory_url, codec=Codec(None, key and SecretKey(key))).verify(2)


def test_no_key_or_a_wrong_key_is_one_error_naming_the_option(tmp_path, memory_url):
    _save(tmp_path, memory_url, remote_encryption_key=KEY)
    for key in (None, os.urandom(32)):
        with CheckpointReader(tmp_path / f"fresh-{key is None}", remote_url=memory_url,
                              remote_encryption_key=key) as reader:
            with pytest.raises(PersistError, match="remote_encryption_key") as e:
                reader.load(step=1)
            assert not isinstance(e.value, CorruptCheckpointError)
    infos = RemoteTier(memory_url).list()  # no key: steps, sizes and "encrypted", nothing more
    assert [(i.step, i.tier) for i in infos] == [(1, "remote (encrypted)")] and infos[0].nbytes > 0


def test_swapped_blocks_are_refused(tmp_path, memory_url):
    _save(tmp_path, memory_url, remote_encryption_key=KEY)
    fs, root = fsspec.core.url_to_fs(memory_url)
    tier = RemoteTier(memory_url, codec=Codec(None, SecretKey(KEY)))
    f = tier.read_manifest(1).files[0]
    lengths = tier.stored.envelope(1).layout[f.name]
    i = next(i for i in range(len(lengths) - 1) if lengths[i] == lengths[i + 1])  # two full blocks, same length
    path = f"{root}/step-{1:012d}/{f.name}"
    raw = bytearray(fs.cat_file(path))
    a = sum(lengths[:i])
    n = lengths[i]
    raw[a : a + n], raw[a + n : a + 2 * n] = raw[a + n : a + 2 * n], raw[a : a + n]
    fs.pipe_file(path, bytes(raw))
    assert any("does not authenticate" in p for p in tier.verify(1))


def test_an_abandoned_checkpoint_replayed_at_a_live_prefix_is_refused(tmp_path, memory_url):
    _save(tmp_path, memory_url, steps=(1, 2), remote_encryption_key=KEY)
    tier = RemoteTier(memory_url, codec=Codec(None, SecretKey(KEY)))
    tier.hide(2, 1)
    tier.set_aside(2, 1)
    assert [c.step for c in tier.abandoned()] == [2]  # still readable as what it is
    fs, root = fsspec.core.url_to_fs(memory_url)
    aside = next(p for p in fs.ls(root, detail=False) if "abandoned" in p)
    for p in fs.find(aside):  # the attacker puts its objects back at the live prefix
        fs.pipe_file(f"{root}/step-{2:012d}/{p.rsplit('/', 1)[-1]}", fs.cat_file(p))
    assert tier.committed_steps() == [1, 2]
    with pytest.raises(CorruptCheckpointError, match="set aside"):
        tier.read_manifest(2)
    assert [c.step for c in tier.list()] == [1]


def test_the_key_is_never_pickled_nor_shown(tmp_path, memory_url):
    from persist_core.config import Config

    config = Config(local_dir=tmp_path, remote_url=memory_url, remote_encryption_key=KEY)
    assert KEY.hex() not in repr(config) and str(KEY) not in repr(config)
    with pytest.raises(TypeError, match="remote_encryption_key is not pickled"):
        pickle.dumps(config)
    by_callable = Config(local_dir=tmp_path, remote_url=memory_url, remote_encryption_key=_key)
    assert pickle.loads(pickle.dumps(by_callable)).remote_encryption_key.bytes() == KEY
    with pytest.raises(ConfigError, match="remote_encryption_key has 16 bytes"):
        Config(local_dir=tmp_path, remote_url=memory_url, remote_encryption_key=b"x" * 16)


def _key() -> bytes:
    return KEY


@pytest.mark.parametrize("option,package,extra", [("remote_compression", "zstandard", "compress"),
                                                  ("remote_encryption_key", "cryptography", "encrypt")])
def test_a_codec_whose_package_is_missing_names_the_extra(tmp_path, memory_url, monkeypatch, option, package, extra):
    real = builtins.__import__

    def without(name, *args, **kwargs):
        if name.split(".")[0] == package:
            raise ImportError(f"No module named {package!r}")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without)
    value = "zstd" if option == "remote_compression" else KEY
    with pytest.raises(ConfigError, match=rf"torch-persist\[{extra}\]"):
        CheckpointEngine(tmp_path / "a", remote_url=memory_url, **{option: value})
