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
