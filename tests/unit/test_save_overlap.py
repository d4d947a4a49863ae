"""Overlapped snapshots: with a guard, save() returns before the parameters are copied, and the next
optimizer.step() waits for that copy; the checkpoint is the state at the moment of save()."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from persist_core import CheckpointEngine, ConfigError
from persist_core.hostmem import copy_here
from tests.support.fakes import record_upload_turns
from tests.support.states import assert_state_equal


def _gate_the_copy(engine: CheckpointEngine, gate: threading.Event) -> None:
    """Hold the background copy until ``gate`` opens (so the test decides what runs before it)."""
    run = engine._overlap.run
    engine._overlap.run = lambda handle, fn: run(handle, lambda: (gate.wait(), fn()))


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return model, opt


def _snapshot(model, opt) -> dict:
    return {"model": type(model.state_dict())((k, v.detach().clone()) for k, v in model.state_dict().items()),
            "optim": {k: {n: t.clone() if isinstance(t, torch.Tensor) else t for n, t in s.items()}
                      for k, s in opt.state_dict()["state"].items()}}


def test_a_guarded_save_returns_before_the_copy_and_the_next_step_waits_for_it(tmp_path):
    model, opt = _model_and_optimizer()
    gate = threading.Event()
    opt.register_step_pre_hook(lambda *_: gate.set())  # runs before the guard's fence: the copy may go on now
    with CheckpointEngine(tmp_path) as engine:
        engine.guard(opt)
        _gate_the_copy(engine, gate)
        before = _snapshot(model, opt)
        handle = engine.save({"model": model.state_dict(), "optim": opt.state_dict()["state"]}, step=1)
        with pytest.raises(TimeoutError):
            handle.wait_staged(timeout=0.01)  # returned before the parameters were copied
        assert not handle.staged.done()
        model(torch.randn(4, 8)).sum().backward()  # the next forward/backward (BatchNorm's stats change)
        opt.step()  # mutates parameters and moments: only once the copy is done
        assert handle.staged.done() and handle.staged.exception() is None
        handle.wait()
        assert handle.stats.stall_s > 0
        saved = engine.load(1)
    assert_state_equal(saved["model"], before["model"])  # BatchNorm buffers too: copied before save() returned
    assert_state_equal(saved["optim"], before["optim"])
    assert not torch.equal(saved["model"]["0.weight"], model.state_dict()["0.weight"])  # the step did happen


def test_without_a_guard_save_returns_once_everything_is_copied_and_remove_undoes_it(tmp_path):
    model, opt = _model_and_optimizer()
    with CheckpointEngine(tmp_path) as engine:
        handle = engine.save({"model": model.state_dict()}, step=1)
        handle.wait_staged(timeout=0)  # already
        assert handle.staged.done()
        guard = engine.guard(opt)
        guard.remove()
        assert not engine._overlap.active
        engine.save({"model": model.state_dict()}, step=2).wait_staged(timeout=0)
        with pytest.raises(ConfigError, match="needs torch optimizers"):
            engine.guard(object())


def test_guarded_saves_stay_in_order_and_all_commit(tmp_path):
    model, opt = _model_and_optimizer()
    with CheckpointEngine(tmp_path) as engine, engine.guard(opt):
        expected = {}
        for step in range(1, 6):
            expected[step] = _snapshot(model, opt)["model"]
            engine.save({"model": model.state_dict()}, step=step)
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
        engine.wait()
        for step, weights in expected.items():
            assert_state_equal(engine.load(step)["model"], weights)


def test_a_parameter_changed_in_place_before_the_background_copy_fails_that_save_and_commits_nothing(tmp_path):
    from persist_core import PersistError

    model, opt = _model_and_optimizer()
    gate = threading.Event()
    with CheckpointEngine(tmp_path) as engine:
        engine.guard(opt)
        engine.save({"model": model.state_dict(), "optim": opt.state_dict()["state"]}, step=1).wait()
        _gate_the_copy(engine, gate)
        handle = engine.save({"model": model.state_dict(), "optim": opt.state_dict()["state"]}, step=2)
        with torch.no_grad():  # not the guarded step: e.g. an EMA or a manual update, before any fence
            model[0].weight.mul_(0.5)
        gate.set()
        with pytest.raises(PersistError, match=r"state entry model/0\.weight was changed in place after save\(\)"):
            handle.wait()
        assert [c.step for c in engine.list()] == [1]  # nothing committed for step 2; step 1 intact
        handle = engine.save({"model": model.state_dict(), "optim": opt.state_dict()["state"]}, step=3)
        opt.step()  # the guarded step: waits for the copy, so this save is one consistent moment
        handle.wait()
        assert [c.step for c in engine.list()] == [1, 3]


def test_a_guarded_saves_duration_counts_its_background_copy(tmp_path):
    """save() called -> committed: the background copy is part of it (D, what policies weigh), not only the write."""
    model, opt = _model_and_optimizer()
    gate = threading.Event()
    with CheckpointEngine(tmp_path) as engine, engine.guard(opt):
        _gate_the_copy(engine, gate)
        called = time.perf_counter()
        handle = engine.save({"model": model.state_dict()}, step=1)
        threading.Event().wait(0.2)  # training goes on while the copy is held back
        opened = time.perf_counter()
        gate.set()
        handle.wait()
        assert handle.stats.stall_s + handle.stats.commit_s >= opened - called


def test_a_turn_holds_writers_until_released_and_a_forgotten_hold_ends_by_itself():
    from persist_core.turn import Turn

    turn = Turn()
    turn.hold()
    writer = threading.Thread(target=turn.wait)
    writer.start()
    writer.join(timeout=0.05)
    assert writer.is_alive()  # held: the writer waits for the update to end
    turn.release()
    writer.join(timeout=5)
    assert not writer.is_alive() and turn.held_s > 0
    turn = Turn(max_hold_s=0.05)
    turn.hold()  # never released (an update that raised before its post-hook)
    t0 = time.perf_counter()
    turn.wait()
    assert 0.04 <= time.perf_counter() - t0 < 2


def test_while_a_guarded_update_runs_the_background_writes_hold_off(tmp_path):
    """From the fence to the optimizer's step post-hook the host is the update's: no checksum or pwrite of the
    pending save runs (a CPU-bound update would otherwise share its cores with them); after it, the save commits."""
    from persist_core.fileio import OsFileOps

    inside, wrote, during = threading.Event(), threading.Event(), []

    class Ops(OsFileOps):
        def open(self, path, flags, mode=0o644):
            inside.wait(timeout=10)  # the shard's write starts once the update runs (no race with the hold)
            return super().open(path, flags, mode)

        def pwrite(self, fd, data, offset):
            wrote.set()
            return super().pwrite(fd, data, offset)

    model, opt = _model_and_optimizer()
    with CheckpointEngine(tmp_path, file_ops=Ops()) as engine, engine.guard(opt):
        handle = engine.save({"model": model.state_dict(), "optim": opt.state_dict()["state"]}, step=1)

        def update(*_):  # registered after the guard's pre-hook: runs after its fence, inside the update
            inside.set()
            during.append(wrote.wait(timeout=0.2))

        hook = opt.register_step_pre_hook(update)
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        hook.remove()
        handle.wait(timeout=30)  # the post-hook gave the writers their turn back
        assert during == [False] and wrote.is_set()
        assert engine._overlap.turn.held_s > 0.1
        assert [c.step for c in engine.list()] == [1]


def test_a_hold_that_starts_while_a_chunk_is_written_stops_its_next_piece(tmp_path):
    """A guarded engine writes each chunk in pwrites of at most 4 MiB, each after the turn: an update that starts
    while a chunk is being written finds at most one piece a thread in flight (one 32 MiB O_DIRECT pwrite ran on
    through the update and slowed it by a tenth on this host). Without a guard a chunk is one pwrite."""
    from persist_core.fileio import YIELD_PIECE_BYTES, OsFileOps

    first, held, second = threading.Event(), threading.Event(), threading.Event()
    sizes: list[int] = []

    class Ops(OsFileOps):
        def pwrite(self, fd, data, offset):
            if threading.current_thread().name.startswith("persist-io"):  # the shard's (not the manifest's)
                sizes.append(len(data))
                if len(sizes) == 1:
                    first.set()
                    held.wait(timeout=10)  # in flight when the update starts
                else:
                    second.set()
            return super().pwrite(fd, data, offset)

    model, opt = _model_and_optimizer()
    big = {"buffer": torch.randn(3 * YIELD_PIECE_BYTES // 4)}  # 3 pieces' worth, one 32 MiB chunk
    during = []
    with CheckpointEngine(tmp_path / "guarded", file_ops=Ops(), write_threads=1) as engine, engine.guard(opt):
        handle = engine.save({"model": model.state_dict(), **big}, step=1)

        def update(*_):  # after the guard's pre-hook: the turn is held
            held.set()
            during.append(second.wait(timeout=0.2))

        hook = opt.register_step_pre_hook(update)
        model(torch.randn(4, 8)).sum().backward()
        assert first.wait(timeout=10)  # the first piece is being written
        opt.step()
        hook.remove()
        handle.wait(timeout=30)
    assert during == [False]  # no piece started while the update ran
    assert len(sizes) >= 3 and max(sizes) <= YIELD_PIECE_BYTES and sum(sizes) == handle.stats.nbytes
    sizes.clear()
    with CheckpointEngine(tmp_path / "plain", file_ops=Ops(), write_threads=1) as engine:  # its events all set
        handle = engine.save({"model": model.state_dict(), **big}, step=1)
        handle.wait(timeout=30)
    assert sizes == [handle.stats.nbytes]  # no guard: the chunk in one pwrite


def test_an_update_that_raises_does_not_leave_the_writes_held(tmp_path):
    model, opt = _model_and_optimizer()
    with CheckpointEngine(tmp_path) as engine, engine.guard(opt):
        handle = engine.save({"model": model.state_dict()}, step=1)

        def fail(*_):
            raise RuntimeError("the update failed")

        hook = opt.register_step_pre_hook(fail)  # after the guard's hold: the post-hook never runs
        with pytest.raises(RuntimeError, match="the update failed"):
            opt.step()
        hook.remove()
        engine.wait(timeout=30)  # outside any update: the writers have the host again
        assert handle.done() and [c.step for c in engine.list()] == [1]


def test_a_fence_whose_step_never_runs_is_ended_by_after_update_or_by_removing_the_guard(tmp_path):
    """Lightning fences in on_before_optimizer_step, and a GradScaler may then skip the step (no post-hook):
    its callback calls after_update() at the batch's end; removing the guard ends a hold too."""
    model, opt = _model_and_optimizer()
    with CheckpointEngine(tmp_path) as engine:
        guard = engine.guard(opt, step_hook=False)
        turn = engine._overlap.turn
        engine.fence()  # the update is about to run ... and is skipped
        writer = threading.Thread(target=turn.wait)
        writer.start()
        writer.join(timeout=0.05)
        assert writer.is_alive()
        engine.after_update()
        writer.join(timeout=5)
        assert not writer.is_alive()
        engine.fence()
        guard.remove()
        t0 = time.perf_counter()
        turn.wait()
        assert time.perf_counter() - t0 < 0.5  # not the 1 s a forgotten hold lasts


def test_the_wait_at_the_fence_is_reported_apart_from_the_stall(tmp_path):
    model, opt = _model_and_optimizer()
    gate = threading.Event()
    with CheckpointEngine(tmp_path) as engine:
        engine.guard(opt)
        _gate_the_copy(engine, gate)
        handle = engine.save({"model": model.state_dict(), "optim": opt.state_dict()["state"]}, step=1)
        model(torch.randn(4, 8)).sum().backward()
        opener = threading.Timer(0.3, gate.set)  # the copy ends 0.3 s from now, after the update asked for it
        opener.start()
        opt.step()  # waits at the fence until the copy is done
        handle.wait()
        opener.join()
        stats = handle.stats
        assert stats.fence_s >= 0.25  # what the update waited for this save's copy
        assert stats.stall_s < stats.fence_s  # save() itself returned after planning
        assert stats.metrics()["persist/fence_s"] == stats.fence_s
        summary = engine.summary()
        assert summary["fence_wait_s"] == pytest.approx(stats.fence_s)
        assert summary["stall_p50_s"] == pytest.approx(stats.stall_s)
        assert summary["overlapped_saves"] == 1  # its copy ran in the background
        engine.save({"model": model.state_dict()}, step=2).wait()  # unguarded tensors only: no fence
        opt.step()
        assert engine.summary()["fence_wait_s"] == pytest.approx(stats.fence_s)


def test_removing_the_guard_lets_a_pending_copy_finish_first(tmp_path):
    model, opt = _model_and_optimizer()
    gate = threading.Event()
    with CheckpointEngine(tmp_path) as engine:
        guard = engine.guard(opt)
        _gate_the_copy(engine, gate)
        before = _snapshot(model, opt)
        handle = engine.save({"model": model.state_dict(), "optim": opt.state_dict()["state"]}, step=1)
        opener = threading.Timer(0.2, gate.set)
        opener.start()
        guard.remove()  # no update will wait for the copy now: it ends before remove() returns
        opener.join()
        handle.wait_staged(timeout=0)
        model(torch.randn(4, 8)).sum().backward()
        opt.step()  # unguarded from here: changes the parameters at once
        handle.wait()
        saved = engine.load(1)
    assert_state_equal(saved["model"], before["model"])
    assert_state_equal(saved["optim"], before["optim"])
    assert handle.stats.fence_s == 0  # no update waited for it


def test_uploads_through_fsspec_wait_for_the_turn_too(tmp_path, monkeypatch):
    import uuid

    callers = record_upload_turns(monkeypatch)
    with CheckpointEngine(tmp_path, remote_url=f"memory:///turn-{uuid.uuid4().hex[:8]}") as engine:
        engine.save({"w": torch.zeros(1 << 20)}, step=1).wait_remote()
    assert "persist-sync" in callers  # the upload (fsspec's put_file on the sync thread) asked for its turn


def _os_threads() -> set[str]:
    # The process's threads by id: a thread another test left behind may end meanwhile (a count would
    # then miss a new one), but no id absent before can appear unless a thread was started.
    return set(os.listdir("/proc/self/task"))


def _names(tids: set[str]) -> list[str]:
    names = []
    for tid in sorted(tids):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f"{tid}:{f.read().strip()}")
        except OSError:
            names.append(f"{tid}:(ended)")
    return names


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or torch.get_num_threads() < 2,
                    reason="counts the process's threads (Linux) and needs intra-op parallelism (2+ threads)")
def test_the_background_copy_starts_no_parallel_team_that_would_slow_the_training_s_own_ops(tmp_path):
    # A parallel torch op run from a thread other than the main one makes OpenMP start a second team of
    # worker threads for that thread, kept while it lives; once the process has more OpenMP threads than
    # cores, every parallel region of the training (an optimizer step, a matmul) wakes its workers the slow
    # way: on 2 cores the in-place update of a 0.3 GB model went from 25 to 46 ms for the rest of the run.
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024)  # 1 M elements: copy_ would run it in parallel
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()
    state = lambda: {"model": model.state_dict(), "optim": opt.state_dict()}  # noqa: E731
    tiny = torch.nn.Parameter(torch.zeros(4))  # copied in the background too, but too small to run in parallel
    with CheckpointEngine(tmp_path) as engine, engine.guard(opt, torch.optim.SGD([tiny], lr=0.1)):
        engine.save({"tiny": tiny}, step=0).wait()  # the engine's own threads, the copy thread too, are started
        warming = engine._parts.pool._warming  # the staging slots' warm-up thread, if still running, ends first
        if warming is not None:
            warming.join()
        threads = _os_threads()
        before = _snapshot(model, opt)
        handle = engine.save(state(), step=1)
        opt.step()  # waits for the background copy
        handle.wait()
        assert engine.summary()["overlapped_saves"] == 2
        started = _os_threads() - threads
        assert not started, f"threads started by the save: {_names(started)}"
        saved = engine.load(1)
    assert_state_equal(saved["model"], before["model"])
    assert_state_equal(saved["optim"]["state"], before["optim"])


@pytest.mark.parametrize("make", [
    lambda: torch.randn(300, 400),  # contiguous: one memmove
    lambda: torch.randn(400, 300).t(),  # strided, rows under the grain
    lambda: torch.randn(3, 40000)[:, ::2],  # strided, rows over it
    lambda: torch.randn(70000).to(torch.float64),  # another dtype: converted as copy_ converts
    lambda: torch.randn(1, 50000).expand(2, 50000),  # zero stride
    lambda: torch.randn(200, 300, dtype=torch.complex64).conj(),  # a lazy conjugate: resolved, not raw bytes
    lambda: torch.tensor(3.5),
    lambda: torch.empty(0, 5),
])
def test_copy_here_copies_what_copy_copies(make):
    src = make()
    dst = torch.empty(src.shape, dtype=torch.complex64 if src.is_complex() else torch.float32)
    copy_here(dst, src)
    assert torch.equal(dst, torch.empty_like(dst).copy_(src))
