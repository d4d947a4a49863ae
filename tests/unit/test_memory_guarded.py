"""Guarded snapshots (issue 42): behind ``engine.guard(opt)`` a memory snapshot copies the optimizer's parameters
and state while the next forward and backward run, as a guarded disk save does; the optimizer's next update waits
for that copy, so the snapshot is the state at the moment of ``maybe_save``.

Users' scenario: a plain loop that guards its optimizer and calls ``maybe_save`` every step with a memory tier;
the process dies (a crash that keeps the snapshots) and the restart reads the newest step from memory."""

from __future__ import annotations

from pathlib import Path

import torch

from persist_core import CheckpointEngine, CheckpointReader, EveryNSteps, MemoryTier
from tests.support.states import assert_state_equal


def _train(tmp_path: Path, *, steps: int, policy=None, every: int = 1):
    """A guarded loop; returns the state each step saved (cloned at ``maybe_save``) and the engine's summary."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    memory = MemoryTier(every_n_steps=every, memory_dir=tmp_path / "shm")
    expected = {}
    engine = CheckpointEngine(tmp_path / "ckpt", memory=memory, save_policy=policy)
    engine.guard(opt)
    for step in range(1, steps + 1):
        loss = model(torch.randn(8, 256)).square().mean()
        loss.backward()
        opt.step()  # the pre-hook waits for the previous step's background copy first
        opt.zero_grad()

        def state():
            return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
        engine.maybe_save(state, step)
        expected[step] = {"model": type(model.state_dict())((k, v.clone()) for k, v in model.state_dict().items()), "step": step}
    # one more update after the last snapshot: it must not reach the snapshot of the last step
    model(torch.randn(8, 256)).square().mean().backward()
    opt.step()
    summary = engine.summary()
    engine.wait()
    engine.close(keep_memory=True)  # the process died: its snapshots stay for the restart
    return expected, summary, memory


def test_a_guarded_snapshot_copies_in_the_background_and_holds_the_state_of_its_step(tmp_path):
    expected, summary, memory = _train(tmp_path, steps=6)
    assert summary["overlapped_saves"] >= 5, summary  # the copies ran behind the next steps (the first may not)
    with CheckpointReader(tmp_path / "ckpt", memory=memory) as reader:
        assert reader.memory_steps() and max(reader.memory_steps()) == 6
        assert reader.list() == []  # nothing on disk: memory only
        got = reader.load()
    assert got["step"] == 6
    assert_state_equal(got["model"], expected[6]["model"])  # not the update made after it


def test_a_guarded_disk_save_is_a_memory_snapshot_too(tmp_path):
    # the memory tier's own steps are rare; the disk policy saves every 2 steps, guarded
    expected, _, memory = _train(tmp_path, steps=6, policy=EveryNSteps(2), every=1000)
    with CheckpointReader(tmp_path / "ckpt", memory=memory) as reader:
        assert 6 in reader.memory_steps(), reader.memory_steps()
        assert [c.step for c in reader.list()][-1] == 6
        got = reader.load()
    assert_state_equal(got["model"], expected[6]["model"])


def test_a_guarded_snapshot_whose_copy_fails_midway_leaves_the_older_one_newest_and_the_next_commits(tmp_path,
                                                                                                       monkeypatch):
    # the checksums of a guarded snapshot follow its copy block by block: a copy that fails after some blocks were
    # checksummed (a parameter changed in place outside the guard) records nothing, and nothing waits forever
    import threading

    import persist_core.staging.stage as stage

    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    memory = MemoryTier(memory_dir=tmp_path / "shm")
    engine = CheckpointEngine(tmp_path / "ckpt", memory=memory, chunk_bytes=64 << 10)
    engine.guard(opt)
    gate, entered, copies = threading.Event(), threading.Event(), []
    real = stage.hostmem.copy_here

    def copy_here(dst, src):  # step 2's second deferred copy waits until the test has changed a parameter
        copies.append(src)
        if held[0] and len(copies) == 2:
            entered.set()
            assert gate.wait(30)
        real(dst, src)
    monkeypatch.setattr(stage.hostmem, "copy_here", copy_here)
    held = [False]
    expected = {}
    for step in (1, 2, 3):
        model(torch.randn(4, 512)).sum().backward()
        opt.step()
        held[0], copies[:] = step == 2, []
        engine.maybe_save(lambda: {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, step)
        expected[step] = type(model.state_dict())((k, v.clone()) for k, v in model.state_dict().items())
        if step == 2:
            assert entered.wait(30)
            with torch.no_grad():
                model[1].bias.add_(1.0)  # in place, outside the guarded update: step 2's copy must fail
            gate.set()
            engine.fence()
            with CheckpointReader(tmp_path / "ckpt", memory=memory) as reader:
                assert max(reader.memory_steps()) == 1  # step 2's record was never written
            expected[2] = None
    engine.wait()
    engine.close(keep_memory=True)
    with CheckpointReader(tmp_path / "ckpt", memory=memory) as reader:
        assert 2 not in reader.memory_steps() and max(reader.memory_steps()) == 3
        got = reader.load()
    assert got["step"] == 3
    assert_state_equal(got["model"], expected[3])
