"""Issue 56 through each adapter, as a user on a fresh machine: a run with ``remote_compression`` and
``remote_encryption_key`` on the real Lightning ``Trainer``, ``Accelerator`` and HF ``Trainer``; a new ``local_dir``
with the key (a callable) resumes from the remote bit-exact, and nothing on the remote reads in the clear."""

from __future__ import annotations

import logging

import fsspec
import pytest

from persist_core import CheckpointReader
from tests.support.states import assert_state_equal

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")]

KEY = bytes(range(50, 82))
OPTIONS = {"remote_compression": "zstd"}


def _no_plaintext(url: str, *needles: bytes) -> None:
    fs, root = fsspec.core.url_to_fs(url)
    stored = {p: fs.cat_file(p) for p in fs.find(root)}
    assert stored
    for needle in needles:
        assert not [p for p, b in stored.items() if needle in b], needle


def test_lightning_a_fresh_machine_resumes_an_encrypted_compressed_remote(tmp_path, memory_url, caplog):
    from lightning_persist import PersistCheckpointIO
    from tests.support.lightning_app import Net, make_trainer, weights

    caplog.set_level(logging.DEBUG)
    io = PersistCheckpointIO(local_dir=tmp_path / "a", remote_url=memory_url, remote_encryption_key=KEY, **OPTIONS)
    model = Net()
    make_trainer(io, tmp_path / "a", 4).fit(model)
    _no_plaintext(memory_url, b"net.0.weight", b"global_step")
    fresh = PersistCheckpointIO(local_dir=tmp_path / "b", remote_url=memory_url, remote_encryption_key=lambda: KEY,
                                **OPTIONS)
    assert fresh.latest_path() == f"{memory_url}/step-{4:012d}"
    resumed = Net()
    trainer = make_trainer(fresh, tmp_path / "b", 4)
    trainer.fit(resumed, ckpt_path=fresh.latest_path())  # restores step 4, trains nothing more
    assert trainer.global_step == 4
    assert_state_equal(weights(resumed), weights(model))
    assert KEY.hex() not in caplog.text and repr(KEY) not in caplog.text


def test_accelerate_a_fresh_machine_resumes_an_encrypted_compressed_remote(tmp_path, memory_url):
    from accelerate_persist import PersistHook
    from tests.support.accelerate_app import build, fresh_accelerator, train, weights

    acc = fresh_accelerator()
    parts = build(acc)
    with PersistHook(local_dir=tmp_path / "a", remote_url=memory_url, remote_encryption_key=KEY,
                     **OPTIONS).register(acc) as hook:
        train(acc, *parts, start=0, stop=3)
        acc.save_state()
        hook.wait()
    saved = weights(parts[0])
    _no_plaintext(memory_url, b"param_groups", b"optimizer")
    acc = fresh_accelerator()
    parts = build(acc)
    hook = PersistHook(local_dir=tmp_path / "b", remote_url=memory_url, remote_encryption_key=lambda: KEY, **OPTIONS)
    with hook.register(acc):
        assert hook.latest() == f"{memory_url}/step-{3:012d}"
        assert hook.resume() == 3
    assert_state_equal(weights(parts[0]), saved)


def test_hf_trainer_a_fresh_machine_resumes_an_encrypted_compressed_remote(tmp_path, memory_url):
    from accelerate_persist import PersistTrainerCallback
    from tests.adapters.test_hf_trainer import train

    train(tmp_path / "out1", [PersistTrainerCallback(tmp_path / "a", remote_url=memory_url, remote_encryption_key=KEY,
                                                     **OPTIONS)], max_steps=4)
    _no_plaintext(memory_url, b"classifier.weight", b"log_history")
    callback = PersistTrainerCallback(tmp_path / "b", remote_url=memory_url, remote_encryption_key=lambda: KEY,
                                      **OPTIONS)
    path = callback.resume_path()  # read through the callback's own reader, with the key
    assert path is not None and path.endswith("checkpoint-4")
    resumed = train(tmp_path / "out2", [callback], resume=path, max_steps=6)  # a fresh machine that did not resume
    assert resumed.state.global_step == 6                                    # would be refused at its first save
    with CheckpointReader(tmp_path / "c", remote_url=memory_url, remote_encryption_key=KEY) as reader:
        assert [c.step for c in reader.list("remote")] == [2, 4, 6]
