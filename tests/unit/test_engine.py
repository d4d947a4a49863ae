"""The engine's protocols: snapshot semantics, commit, verification, errors raised once."""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch

import persist_core

from persist_core import (
    CheckpointReader,
    CheckpointEngine,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    PersistError,
    StepExistsError,
    WriteError,
)
from persist_core.format import Manifest
from persist_core.ownership import claim_tmp
from persist_core.staging.pool import StagingBuffer
from tests.support.states import assert_state_equal
from tests.support.fakes import FailingOps, GatedOps, NoDirectOps
from functools import partial
from tests.support import states


state_for = partial(states.state_for, shape=(256, 256), random=True)


def test_mutation_after_save_does_not_leak(ckpt_dir):
    ops = GatedOps()
    state = {"w": torch.ones(1000), "nested": {"lst": [1, 2]}, "t": torch.zeros(3)}
    with CheckpointEngine(ckpt_dir, file_ops=ops) as engine:
        handle = engine.save(state, step=5)
        assert ops.entered.wait(60)  # the write has started but cannot finish yet
        state["w"].mul_(7)
        state["nested"]["lst"].append(3)
        state["t"] += 1
        ops.gate.set()
        handle.wait()
        loaded = engine.load(5)
    assert loaded["w"].equal(torch.ones(1000))
    assert loaded["nested"]["lst"] == [1, 2] and loaded["t"].equal(torch.zeros(3))


def test_save_returns_before_commit_and_stats_fill_in(ckpt_dir):
    ops = GatedOps()
    with CheckpointEngine(ckpt_dir, file_ops=ops) as engine:
        handle = engine.save(state_for(1), step=1)
        assert not handle.done() and engine.list() == []
        assert handle.stats.stall_s > 0 and handle.stats.write_s is None
        ops.gate.set()
        handle.wait()
        assert handle.done()
        stats = handle.stats
        assert stats.nbytes >= 256 * 256 * 4 and stats.write_s > 0 and stats.write_gbps > 0 and stats.commit_s > 0
        assert [i.step for i in engine.list()] == [1] and engine.list()[0].nbytes == stats.nbytes


def test_second_save_waits_for_the_write_and_reuses_the_buffer(ckpt_dir, monkeypatch):
    allocations = []
    original = StagingBuffer.__init__

    def counting(self, capacity, **how):
        allocations.append(capacity)
        original(self, capacity, **how)

    monkeypatch.setattr(StagingBuffer, "__init__", counting)
    ops = GatedOps()
    with CheckpointEngine(ckpt_dir, file_ops=ops) as engine:
        engine.save(state_for(1), step=1)
        assert ops.entered.wait(60)
        second: list = []
        saver = threading.Thread(target=lambda: second.append(engine.save(state_for(2), step=2)))
        saver.start()
        saver.join(0.3)
        assert saver.is_alive(), "save() returned while the only staging buffer was still being written"
        ops.gate.set()
        saver.join(60)
        engine.wait()
        assert second[0].stats.wait_s > 0
        assert_state_equal(engine.load(1), state_for(1))
        assert_state_equal(engine.load(2), state_for(2))
    assert len(allocations) == 1


@pytest.mark.parametrize("step", [-1, 1.0, "3", True, None])
def test_bad_step_is_a_config_error_naming_it(ckpt_dir, step):
    with CheckpointEngine(ckpt_dir) as engine:
        with pytest.raises(ConfigError, match=r"step=" + repr(step).replace("(", r"\(")):
            engine.save({"x": torch.ones(1)}, step=step)


def test_repeated_step_is_refused_and_the_first_stays(ckpt_dir):
    with CheckpointEngine(ckpt_dir) as engine:
        engine.save({"x": torch.ones(2)}, step=4).wait()
        with pytest.raises(StepExistsError, match="step=4"):
            engine.save({"x": torch.zeros(2)}, step=4)
        assert engine.load(4)["x"].equal(torch.ones(2))


def test_repeated_pending_step_is_refused(ckpt_dir):
    ops = GatedOps()
    with CheckpointEngine(ckpt_dir, file_ops=ops, max_pending=2) as engine:
        engine.save({"x": torch.ones(2)}, step=4)
        with pytest.raises(StepExistsError):
            engine.save({"x": torch.zeros(2)}, step=4)
        ops.gate.set()


def test_unwritable_local_dir_is_a_config_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match=r"local_dir=.*file/ckpt.*writable"):
        CheckpointEngine(blocker / "ckpt")


@pytest.mark.parametrize("kwargs", [{"write_threads": 0}, {"chunk_bytes": 1000}, {"direct_io": "maybe"}, {"max_pending": 0},
                                    {"remote_timeout_s": 0}, {"remote_timeout_s": True}, {"max_unsynced_bytes": -1}])
def test_bad_settings_are_config_errors(ckpt_dir, kwargs):
    (name, value), = kwargs.items()
    with pytest.raises(ConfigError, match=f"{name}={value!r}"):
        CheckpointEngine(ckpt_dir, **kwargs)


def test_write_failure_is_raised_once_and_earlier_checkpoints_survive(ckpt_dir):
    ops = FailingOps(fail_at=10**9)
    with CheckpointEngine(ckpt_dir, file_ops=ops, chunk_bytes=64 << 10) as engine:
        engine.save(state_for(1), step=1).wait()
        ops.fail_at = ops.calls + 2
        failed = engine.save(state_for(2), step=2)
        with pytest.raises(WriteError, match=r"step=2.*free space") as info:
            failed.wait()
        assert info.value.errno == errno.ENOSPC and isinstance(info.value.__cause__, OSError)
        failed.wait()  # raised once: the handle is now quiet
        engine.wait()  # and so is the engine
        engine.save(state_for(3), step=3).wait()
    assert [i.step for i in CheckpointReader(ckpt_dir).list()] == [1, 3]
    assert sorted(p.name for p in ckpt_dir.iterdir() if not p.name.startswith((".lock-", ".history"))) == ["step-000000000001", "step-000000000003"]
    assert_state_equal(CheckpointReader(ckpt_dir).load(1), state_for(1))


def test_unobserved_write_failure_is_raised_by_the_next_save(ckpt_dir):
    ops = FailingOps(fail_at=1, err=errno.EIO)
    engine = CheckpointEngine(ckpt_dir, file_ops=ops)
    engine.save(state_for(1), step=1)
    engine._parts.pipeline.writer.drain(None)  # the writer thread has finished step 1
    with pytest.raises(WriteError, match="step=1"):
        engine.save(state_for(2), step=2)
    handle = engine.save(state_for(2), step=2)  # the error was raised once; saving goes on
    engine.close()
    assert handle.done() and [i.step for i in CheckpointReader(ckpt_dir).list()] == [2]


def test_close_raises_a_background_error_once(ckpt_dir):
    engine = CheckpointEngine(ckpt_dir, file_ops=FailingOps(fail_at=1))
    engine.save(state_for(1), step=1)
    with pytest.raises(WriteError):
        engine.close()
    engine.close()
    with pytest.raises(PersistError, match="closed"):
        engine.save(state_for(2), step=2)


def test_real_full_disk(tmp_path):
    """A 2 MiB tmpfs: the second checkpoint does not fit; the first stays loadable."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        with CheckpointEngine(mnt) as engine:
            engine.save({"x": torch.ones(100_000)}, step=1).wait()
            with pytest.raises(WriteError) as info:
                engine.save({"x": torch.ones(1_000_000)}, step=2).wait()
            assert info.value.errno == errno.ENOSPC
            assert engine.load()["x"].equal(torch.ones(100_000))
            assert [p.name for p in mnt.iterdir() if not p.name.startswith((".lock-", ".history"))] == ["step-000000000001"]
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


@pytest.mark.parametrize("where", ["header", "data", "tail"])
def test_flipped_byte_is_caught(ckpt_dir, caplog, where):
    with CheckpointEngine(ckpt_dir) as engine:
        engine.save(state_for(1), step=1).wait()
        engine.save(state_for(2), step=2).wait()
    (shard,) = (ckpt_dir / "step-000000000002").glob("*.safetensors")
    offset = {"header": 20, "data": 4096 + 1234, "tail": shard.stat().st_size - 1}[where]
    _flip_byte(shard, offset)
    engine = CheckpointEngine(ckpt_dir)
    with pytest.raises(CorruptCheckpointError, match=shard.name):
        engine.load(2)
    with caplog.at_level(logging.WARNING):
        assert_state_equal(engine.load(), state_for(1))  # the newest that verifies
    assert "step-000000000002" in caplog.text
    if where != "header":  # a flipped data bit goes unnoticed only when verification is off
        assert engine.load(2, verify=False)["step"] == 2


def test_truncated_or_missing_shard_is_not_listed(ckpt_dir):
    with CheckpointEngine(ckpt_dir) as engine:
        for s in (1, 2, 3):
            engine.save(state_for(s), step=s).wait()
    (shard2,) = (ckpt_dir / "step-000000000002").glob("*.safetensors")
    os.truncate(shard2, shard2.stat().st_size - 4096)
    for f in (ckpt_dir / "step-000000000003").glob("*.safetensors"):
        f.unlink()
    engine = CheckpointEngine(ckpt_dir)
    assert [i.step for i in engine.list()] == [1]
    assert engine.load()["step"] == 1
    with pytest.raises(CorruptCheckpointError, match="missing"):
        engine.load(3)


def test_directory_without_manifest_is_not_a_checkpoint_and_stale_tmp_is_removed(ckpt_dir):
    with CheckpointEngine(ckpt_dir) as engine:
        engine.save(state_for(1), step=1).wait()
    (ckpt_dir / "step-000000000009").mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = ckpt_dir / f".tmp-step-000000000010-pid{int(dead.stdout)}-abc123"
    stale.mkdir()
    (stale / "rank-00000.safetensors").write_bytes(b"partial")
    with claim_tmp(ckpt_dir, 11) as live:  # owned by this live process
        engine = CheckpointEngine(ckpt_dir)
        assert not stale.exists() and live.exists()  # a live owner's directory is left alone
    assert [i.step for i in engine.list()] == [1] and engine.load()["step"] == 1
    with pytest.raises(CheckpointNotFoundError, match="step=9"):
        engine.load(9)


def test_empty_dir_raises_not_found_which_is_a_file_not_found_error(ckpt_dir):
    with pytest.raises(FileNotFoundError, match="no committed checkpoint"):
        CheckpointEngine(ckpt_dir).load()


def test_buffered_writes_and_small_chunks_round_trip(ckpt_dir):
    with CheckpointEngine(ckpt_dir, direct_io="off", chunk_bytes=8192, write_threads=3) as engine:
        handle = engine.save(state_for(1), step=1)
        handle.wait()
        assert handle.stats.direct_io is False
        assert_state_equal(engine.load(), state_for(1))


def test_o_direct_refused_falls_back_to_buffered_writes(ckpt_dir):
    with CheckpointEngine(ckpt_dir, file_ops=NoDirectOps()) as engine:
        handle = engine.save(state_for(1), step=1)
        handle.wait()
        assert handle.stats.direct_io is False
        assert_state_equal(engine.load(), state_for(1))
    with CheckpointEngine(ckpt_dir, file_ops=NoDirectOps(), direct_io="on") as engine:
        with pytest.raises(WriteError, match="step=2"):
            engine.save(state_for(2), step=2).wait()


def test_exit_with_an_exception_still_drains_and_does_not_mask_it(ckpt_dir):
    with pytest.raises(KeyError):
        with CheckpointEngine(ckpt_dir) as engine:
            engine.save(state_for(1), step=1)
            raise KeyError("from the training loop")
    assert [i.step for i in CheckpointReader(ckpt_dir).list()] == [1]


@pytest.mark.slow  # a child interpreter, or a second or more on 2 cores
def test_engine_imports_neither_lightning_nor_accelerate():
    """Every module of persist_core (the CLI included) imports neither adapter nor their frameworks."""
    code = ("import importlib, pkgutil, sys, persist_core\n"
            "for m in pkgutil.walk_packages(persist_core.__path__, 'persist_core.'):\n"
            "    importlib.import_module(m.name)\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in\n"
            "             ('lightning', 'pytorch_lightning', 'accelerate', 'transformers', 'lightning_persist',\n"
            "              'accelerate_persist'))\n"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
    sources = [p for p in Path(persist_core.__file__).parent.rglob("*.py")]
    assert len(sources) > 20
    for path in sources:
        text = path.read_text()
        assert "import accelerate_persist" not in text and "from accelerate_persist" not in text, path
        assert "import lightning_persist" not in text and "from lightning_persist" not in text, path


def test_local_callbacks_run_before_wait_local_returns(tmp_path):
    seen = []
    with CheckpointEngine(tmp_path / "ok") as engine:
        handle = engine.save(state_for(1), step=1)
        handle.add_local_callback(seen.append)
        handle.wait_local()
        assert seen == [True]
        handle.add_local_callback(seen.append)  # after the phase: at once
        assert seen == [True, True]
    with CheckpointEngine(tmp_path / "full", file_ops=FailingOps(fail_at=1)) as engine:
        handle = engine.save(state_for(2), step=2)
        handle.add_local_callback(seen.append)
        with pytest.raises(WriteError):
            handle.wait_local()
        assert seen == [True, True, False]


def big_state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(512, 1024, generator=g), "v": torch.randn(300_000, generator=g), "step": step}


def test_next_save_copies_behind_the_running_write_without_corrupting_it(tmp_path, monkeypatch):
    ops = GatedOps()
    ops.gate.set()
    with CheckpointEngine(tmp_path, file_ops=ops, chunk_bytes=64 << 10, direct_io="off") as engine:
        engine.save(big_state(1), step=1).wait()  # settles the write mode: overlap is on from now
        pool, waiting = engine._parts.pool, threading.Event()
        real_wait_free = pool.wait_free

        def wait_free(buf, end):
            if buf._freed < end:
                waiting.set()
            return real_wait_free(buf, end)

        monkeypatch.setattr(pool, "wait_free", wait_free)
        ops.gate.clear()
        ops.entered.clear()
        engine.save(big_state(2), step=2)  # its write blocks at the gate
        assert ops.entered.wait(30)
        second: list = []
        t = threading.Thread(target=lambda: second.append(engine.save(big_state(3), step=3)))
        t.start()
        assert waiting.wait(30)  # step 3 claimed step 2's buffer and waits for bytes to be written
        ops.gate.set()
        t.join(30)
        assert second[0].stats.wait_s > 0
        engine.wait()
        for step in (1, 2, 3):
            assert_state_equal(engine.load(step), big_state(step))


@pytest.mark.slow  # a child interpreter, or a second or more on 2 cores
def test_a_failed_copy_behind_a_write_gives_the_buffer_back(tmp_path, monkeypatch):
    import persist_core.staging.stage as engine_module

    ops = GatedOps()
    ops.gate.set()
    with CheckpointEngine(tmp_path, file_ops=ops, chunk_bytes=64 << 10, direct_io="off") as engine:
        engine.save(big_state(1), step=1).wait()
        ops.gate.clear()
        ops.entered.clear()
        engine.save(big_state(2), step=2)
        assert ops.entered.wait(30)
        real_stage = engine_module.stage

        def failing_stage(*args, **kwargs):
            raise RuntimeError("device lost mid-copy")

        monkeypatch.setattr(engine_module, "stage", failing_stage)
        with pytest.raises(RuntimeError, match="device lost"):
            engine.save(big_state(3), step=3)  # it had claimed step 2's buffer
        monkeypatch.setattr(engine_module, "stage", real_stage)
        ops.gate.set()
        engine.save(big_state(4), step=4).wait()
        assert [c.step for c in engine.list()] == [1, 2, 4]
        for step in (1, 2, 4):
            assert_state_equal(engine.load(step), big_state(step))


def test_a_manifest_whose_tree_does_not_fit_is_corrupt_and_load_falls_back_naming_it(ckpt_dir, caplog):
    with CheckpointEngine(ckpt_dir) as engine:
        for step in (1, 2):
            engine.save(state_for(step), step=step)
    manifest = ckpt_dir / "step-000000000002" / "manifest.json"
    good = Manifest.from_bytes(manifest.read_bytes(), where="m")
    tree = json.dumps(good.tree, separators=(",", ":"))
    assert tree.count('{"tensor":0}') == 1  # a manifest with its checksum right, naming a tensor not there
    manifest.write_bytes(dataclasses.replace(good, tree=json.loads(tree.replace('{"tensor":0}', '{"tensor":9}'))).to_bytes())
    with CheckpointEngine(ckpt_dir) as engine:
        with pytest.raises(CorruptCheckpointError, match="a tree node names tensor 9"):
            engine.load(2)
        with caplog.at_level(logging.WARNING):
            assert_state_equal(engine.load(), state_for(1))  # before: an IndexError stopped the fallback
    assert "step=2" in caplog.text and "a tree node names tensor 9" in caplog.text


@dataclasses.dataclass
class HyperConfig:
    lr: float = 0.1


def test_a_leaf_that_will_need_full_pickle_to_load_warns_once_at_save_naming_its_key_path(tmp_path):
    from persist_core.format.tree import PickledLeafWarning

    with CheckpointEngine(tmp_path) as engine:
        with pytest.warns(PickledLeafWarning, match=r"state\['hparams/config'\].*HyperConfig.*weights_only=False"):
            engine.save({"w": torch.ones(2), "hparams": {"config": HyperConfig()}}, step=1)
        with warnings.catch_warnings():
            warnings.simplefilter("error", PickledLeafWarning)  # once: the second save is silent
            engine.save({"w": torch.ones(2), "hparams": {"config": HyperConfig(0.2)}}, step=2)
