"""The memory tier where it could lose or mix up a run (issue 42, found by a review): going back then saving
guarded, a failed last save, one step snapshot several times, two jobs under one launcher run id, a reader told
the run id, a forked child holding the lock, a restart on a tmpfs with room for one budget and a half."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from persist_core import CheckpointEngine, CheckpointReader, MemoryTier
from persist_core.errors import PersistError
from tests.support.states import state_for


def _mem(tmp_path: Path, n: int = 1) -> MemoryTier:
    return MemoryTier(every_n_steps=n, memory_dir=tmp_path / "shm")


# a guarded save records no snapshot: the save itself drops the abandoned branch's newer memory records
@pytest.mark.parametrize("guarded", [False, True])
def test_rollback_then_guarded_saves_then_crash_loads_the_abandoned_branch(tmp_path, guarded):
    memory = _mem(tmp_path, n=1000)  # the tier's own snapshots rare; disk saves every step
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def st(step):
        with torch.no_grad():
            model.weight.fill_(float(step))
        return {"model": model.state_dict(), "step": step}

    a = CheckpointEngine(tmp_path / "ckpt", memory=memory)
    a.save(st(5), 5).wait()
    a.snapshot(st(10), 10)  # the old branch reached step 10 in memory
    a.wait()
    a.close(keep_memory=True)  # killed

    b = CheckpointEngine(tmp_path / "ckpt", memory=memory)
    assert b.load(5)["step"] == 5  # the user rolls back to step 5 (a loss spike)
    if guarded:
        b.guard(opt)
    for step in (6, 7, 8):
        b.fence()  # the previous guarded save's copy is done before the weights change
        b.save(st(step), step)
    b.wait()
    b.close(keep_memory=True)  # killed at step 8

    with CheckpointReader(tmp_path / "ckpt", memory=memory) as r:
        got = r.load()
    assert got["step"] == 8, f"loaded step {got['step']} of the abandoned branch from memory"


# close() whose wait() raises (the last disk save failed) keeps the memory snapshots
def test_close_after_a_failed_disk_save_keeps_the_memory_snapshot(tmp_path, monkeypatch):
    from persist_core.save import writer as writer_mod

    memory = _mem(tmp_path)
    engine = CheckpointEngine(tmp_path / "ckpt", memory=memory)
    for step in (1, 2, 3):
        engine.snapshot(state_for(step), step)

    def boom(self, job):
        self._pool.release(job.buf)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer_mod.Writer, "_commit", boom)
    engine.save(state_for(4), 4)
    with pytest.raises(PersistError):
        with engine:
            pass  # the body ended well; the disk save did not
    with CheckpointReader(tmp_path / "ckpt", memory=memory) as r:
        got = r.load()  # step 4 was only ever in memory
    assert got["step"] == 4


# several records of one step: the newest is read
def test_the_newest_of_several_snapshots_of_one_step_is_read(tmp_path):
    memory = _mem(tmp_path)
    engine = CheckpointEngine(tmp_path / "ckpt", memory=memory)
    for i in range(3):  # e.g. Lightning with accumulate_grad_batches: global_step unchanged across batches
        engine.snapshot({"step": 5, "batch": i, "x": torch.full((4096,), float(i))}, 5)
    engine.wait()
    engine.close(keep_memory=True)
    records = sorted(p.name for p in (tmp_path / "shm").rglob("slot-*.json"))
    with CheckpointReader(tmp_path / "ckpt", memory=memory) as r:
        got = r.load()
    assert got["batch"] == 2, f"records {records}: read batch {got['batch']}"


# a restart makes room by removing the killed process's slots (read by then) when the budget does not fit beside them
def test_a_restart_keeps_snapshotting_when_the_tmpfs_fits_one_budget_and_a_half(tmp_path, monkeypatch, caplog):
    from persist_core.memory import store as memory_mod

    memory = _mem(tmp_path)
    def big(step):
        return {"step": step, "x": torch.full((1 << 20,), float(step))}  # 4 MiB

    a = CheckpointEngine(tmp_path / "ckpt", memory=memory)
    for step in range(1, 6):
        a.maybe_save(lambda: big(step), step)
    a.wait()
    a.close(keep_memory=True)  # killed
    slot = max(p.stat().st_size for p in (tmp_path / "shm").rglob("slot-*") if not p.name.endswith(".json"))
    cap = int(3 * slot * 1.5)  # a tmpfs with half a budget (3 slots: two, plus one per disk write) to spare

    def free(self):
        now = sum(p.stat().st_size for p in (tmp_path / "shm").rglob("slot-*") if not p.name.endswith(".json"))
        return cap - now

    monkeypatch.setattr(memory_mod.MemoryStore, "free_bytes", free)
    b = CheckpointEngine(tmp_path / "ckpt", memory=memory)
    with caplog.at_level(logging.WARNING):
        assert b.load()["step"] == 5
        for step in range(6, 11):
            b.maybe_save(lambda: big(step), step)
        b.wait()
    b.close(keep_memory=True)  # killed again
    with CheckpointReader(tmp_path / "ckpt", memory=memory) as r:
        got = r.load()["step"]
    assert got == 10, f"restart resumed at {got}; log: {caplog.text[-400:]}"


# two engines under one launcher run id (a session's weights-only engine has none) never read each other's
def test_weights_only_engine_snapshots_are_not_read_as_the_full_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("PERSIST_RUN_ID", "job-123")
    memory = _mem(tmp_path)
    full = CheckpointEngine(tmp_path / "ckpt", memory=memory)
    weights = CheckpointEngine(tmp_path / "ckpt" / "weights-only", memory=memory)  # as PersistSession.open_kind
    full.snapshot({"step": 100, "model": torch.ones(8), "optim": torch.ones(8)}, 100)
    weights.save({"step": 150, "model": torch.zeros(8)}, 150).wait()
    full.wait()
    full.close(keep_memory=True)
    weights.close(keep_memory=True)
    with CheckpointReader(tmp_path / "ckpt", memory=memory) as r:
        got = r.load()
    assert "optim" in got, f"the full run's reader loaded the weights-only engine's step {got['step']}"


def test_session_weights_only_engine_has_no_memory_tier(tmp_path):
    from lightning_persist import PersistCheckpointIO

    io = PersistCheckpointIO(tmp_path / "ckpt", memory_every_n_steps=1, memory_dir=tmp_path / "shm")
    engine = io._session.open_kind("weights-only")
    try:
        assert engine._parts.snapshots is None, "a weights-only engine maps its own max_pending+2 slots"
    finally:
        io._session.close()


# CheckpointReader(local_dir, memory=...) finds what an engine with run_id= wrote
def test_reader_finds_snapshots_of_an_engine_given_run_id(tmp_path):
    memory = _mem(tmp_path)
    e = CheckpointEngine(tmp_path / "ckpt", memory=memory, run_id="exp-1")
    e.snapshot(state_for(3), 3)
    e.wait()
    e.close(keep_memory=True)
    with CheckpointReader(tmp_path / "ckpt", memory=memory) as r:
        assert r.load()["step"] == 3


# a forked child (a DataLoader worker forked after the first snapshot) inherits the life's flock: close() of a
# finished run still removes its slots
def test_a_finished_run_removes_its_slots_even_with_a_forked_child_alive(tmp_path):
    import multiprocessing
    import time

    memory = _mem(tmp_path)
    engine = CheckpointEngine(tmp_path / "ckpt", memory=memory)
    engine.snapshot(state_for(1), 1)
    engine.wait()
    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(target=time.sleep, args=(20,))  # a worker forked mid-run (inherits the lock's fd)
    child.start()
    try:
        engine.close()  # the run ended well
        left = [p for p in (tmp_path / "shm").rglob("slot-*")]
        assert not left, f"{len(left)} slot files left after a finished run's close()"
    finally:  # SIGKILL: a SIGTERM would run handlers the child inherited (an earlier test's flush, whose pipe the
        child.kill()  # parent's flusher thread reads: the parent would end)
        child.join()




# a tmpfs that fills up after the slots were made (a DataLoader's shared memory): each snapshot's record finds no room
def test_a_full_tmpfs_warns_once_for_the_run_not_once_per_snapshot(tmp_path, monkeypatch, caplog):
    import errno
    import os

    from persist_core.memory import store as memory_mod

    real = memory_mod.write_side_file

    def no_room(path, data, **options):
        if str(path).startswith(str(tmp_path / "shm")) and str(path).endswith(".json"):  # the records
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real(path, data, **options)

    monkeypatch.setattr(memory_mod, "write_side_file", no_room)
    with caplog.at_level(logging.WARNING), CheckpointEngine(tmp_path / "ckpt", memory=_mem(tmp_path)) as engine:
        for step in range(1, 6):
            engine.maybe_save(lambda: state_for(step, (64,)), step)
        engine.wait()
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "No space" in r.getMessage()]
    assert len(said) == 1, said
    assert str(tmp_path / "shm") in said[0]


# a 2-rank run's snapshots, then a resume with 1 process: rank 1's are not read, and that is said once
def test_a_resume_with_fewer_ranks_names_the_ranks_whose_snapshots_are_not_used(tmp_path, caplog):
    import shutil

    memory = _mem(tmp_path)
    first = CheckpointEngine(tmp_path / "ckpt", memory=memory)
    first.snapshot(state_for(3, (64,)), 3)
    first.close(keep_memory=True)  # killed
    (rank0,) = (tmp_path / "shm").glob("*/rank-00000")
    shutil.copytree(rank0, rank0.with_name("rank-00001"))  # as the run's rank 1 left its own
    with caplog.at_level(logging.WARNING), CheckpointEngine(tmp_path / "ckpt", memory=memory) as resumed:
        assert resumed.load()["step"] == 3
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "not used" in r.getMessage()]
    assert len(said) == 1 and "ranks [1]" in said[0] and str(rank0.parent) in said[0], said
