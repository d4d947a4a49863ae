"""Incremental saves that do not copy what did not change (issue 43, "save -> durable"): a host tensor whose bytes
the newest committed checkpoint holds is hashed where it lies at ``save()`` and neither copied nor written; every
other rule holds (a change that bumps no version counter is seen, a full checkpoint at least every ``full_every``
saves, saves in flight, a guard, going back)."""

from __future__ import annotations

import torch

from persist_core import CheckpointEngine, CheckpointReader
from tests.support.states import assert_state_equal
from tests.unit.test_incremental import BASE, _frozen, _manifest, _state


def test_the_unchanged_base_is_not_copied_and_every_step_loads_bit_exact(tmp_path):
    base = _frozen()
    states = {step: _state(step, base) for step in range(1, 6)}
    stats = {}
    with CheckpointEngine(tmp_path, incremental=True, full_every=4) as engine:
        for step, state in states.items():
            handle = engine.save(state, step=step)
            handle.wait()
            stats[step] = handle.stats
    assert stats[1].unchanged_bytes == 0  # the first save: nothing committed to compare with
    for step in (2, 3, 4):  # the base (and the frozen encoder) hashed where they lie, not copied
        assert stats[step].unchanged_bytes >= 4 * BASE, (step, stats[step])
        assert stats[step].nbytes < 64 * 1024
    assert stats[5].unchanged_bytes == 0 and not _manifest(tmp_path, 5).depends_on()  # due full: copied whole
    with CheckpointReader(tmp_path) as reader:
        for step, state in states.items():
            assert_state_equal(reader.load(step=step), state)


def test_a_change_made_through_data_after_a_save_is_copied_and_written(tmp_path):
    base = _frozen()
    with CheckpointEngine(tmp_path, incremental=True) as engine:
        engine.save(_state(1, base), step=1).wait()
        engine.save(_state(2, base), step=2).wait()
        base.data[BASE - 1] = 7.0  # no version counter moves
        h = engine.save(_state(3, base), step=3)
        h.wait()
        assert h.stats.unchanged_bytes < 4 * BASE  # the base is copied and written again
        assert_state_equal(engine.load(step=3), _state(3, base))
        assert engine.load(step=3)["model"]["base.weight"][BASE - 1] == 7.0
        assert_state_equal(engine.load(step=2)["model"]["base.weight"][: BASE - 1], base[: BASE - 1])


def test_saves_in_flight_keep_a_full_checkpoint_at_least_every_full_every_saves(tmp_path):
    base = _frozen()
    states = {step: _state(step, base) for step in range(1, 17)}
    with CheckpointEngine(tmp_path, incremental=True, full_every=5, max_pending=2) as engine:
        handles = [engine.save(state, step=step) for step, state in states.items()]  # no wait between them
        engine.wait()
    assert any(h.stats.unchanged_bytes for h in handles)
    full = [step for step in states if not _manifest(tmp_path, step).depends_on()]
    assert full[0] == 1 and all(b - a <= 5 for a, b in zip(full, full[1:] + [17])), full
    with CheckpointReader(tmp_path) as reader:
        for step, state in states.items():
            assert_state_equal(reader.load(step=step), state)


def test_a_guarded_loop_references_the_frozen_base_and_loads_what_each_step_held(tmp_path):
    frozen = torch.nn.Linear(512, 512)
    frozen.requires_grad_(False)
    adapter = torch.nn.Linear(512, 8)
    opt = torch.optim.Adam(adapter.parameters(), lr=1e-2)
    saved = {}
    with CheckpointEngine(tmp_path, incremental=True) as engine:
        engine.guard(opt)
        for step in range(1, 5):
            adapter(frozen(torch.randn(4, 512))).square().mean().backward()
            opt.step()
            opt.zero_grad()
            state = {"frozen": frozen.state_dict(), "adapter": adapter.state_dict(), "optim": opt.state_dict()}
            h = engine.save(state, step=step)
            saved[step] = {"frozen": {k: v.clone() for k, v in frozen.state_dict().items()},
                           "adapter": {k: v.clone() for k, v in adapter.state_dict().items()}}
            h.wait()
            if step > 1:
                assert h.stats.unchanged_bytes >= 512 * 512 * 4, h.stats
        for step, want in saved.items():
            got = engine.load(step=step)
            for part in ("frozen", "adapter"):
                for k, v in want[part].items():
                    assert torch.equal(got[part][k], v), (step, part, k)


def test_what_a_save_in_flight_found_unchanged_is_kept_by_retention_until_it_is_committed(tmp_path):
    from persist_core import KeepLastN
    from tests.support.fakes import GatedStepOps

    b0, b1 = _frozen(), _frozen() + 1.0

    def state(step: int, base: torch.Tensor) -> dict:
        return {"base": base, "adapter": torch.full((64,), float(step)), "step": step}

    ops = GatedStepOps(3)
    with CheckpointEngine(tmp_path, incremental=True, keep_local=KeepLastN(1), max_pending=2, file_ops=ops,
                          direct_io="off") as engine:
        engine.save(state(1, b0), step=1).wait()  # full: holds b0
        engine.save(state(2, b0), step=2).wait()  # references step 1's b0
        engine.save(state(3, b1), step=3)  # b1 written: step 3 references nothing; its commit waits at the gate
        assert ops.entered.wait(30)
        fourth = engine.save(state(4, b0), step=4)  # b0 again: hashed where it lies, equal to step 2's, not copied
        assert fourth.stats.unchanged_bytes >= 4 * BASE
        ops.gate.set()  # step 3 commits; KeepLastN(1) keeps it alone, but step 1 holds what step 4 references
        fourth.wait()
        assert _manifest(tmp_path, 4).depends_on() == {1}
        assert [c.step for c in engine.list()] == [1, 4]
        assert_state_equal(engine.load(step=4), state(4, b0))


def test_a_referenced_checkpoint_removed_by_hand_makes_the_next_save_copy_and_write_its_bytes(tmp_path):
    import shutil

    base = _frozen()
    with CheckpointEngine(tmp_path, incremental=True) as engine:
        engine.save(_state(1, base), step=1).wait()
        engine.save(_state(2, base), step=2).wait()  # references step 1's base
        shutil.rmtree(tmp_path / "step-000000000001")
        for step in (3, 4, 5):  # every save commits: the base is copied and written again, then referenced
            engine.save(_state(step, base), step=step).wait()
        assert [c.step for c in engine.list()] == [2, 3, 4, 5]
        assert not _manifest(tmp_path, 3).depends_on() and _manifest(tmp_path, 5).depends_on() == {3}
        for step in (3, 4, 5):
            assert_state_equal(engine.load(step=step), _state(step, base))


def test_retention_during_the_hash_before_the_copy_keeps_what_the_save_may_reference(tmp_path, monkeypatch):
    from persist_core import KeepLastN
    from persist_core.save import dedup
    from tests.support.fakes import GatedStepOps

    b0, b1 = _frozen(), _frozen() + 1.0

    def state(step: int, base: torch.Tensor) -> dict:
        return {"base": base, "adapter": torch.full((64,), float(step)), "step": step}

    ops = GatedStepOps(3)
    handles = {}
    digest = dedup._source_digest

    def hashing(c):  # while step 4 hashes, step 3 commits and KeepLastN(1) removes what no kept one references
        ops.gate.set()
        handles[3].wait()
        return digest(c)

    with CheckpointEngine(tmp_path, incremental=True, keep_local=KeepLastN(1), max_pending=2, file_ops=ops,
                          direct_io="off") as engine:
        engine.save(state(1, b0), step=1).wait()
        engine.save(state(2, b0), step=2).wait()
        handles[3] = engine.save(state(3, b1), step=3)  # b1: step 3 references nothing
        assert ops.entered.wait(30)
        monkeypatch.setattr(dedup, "_source_digest", hashing)
        fourth = engine.save(state(4, b0), step=4)
        fourth.wait()
        assert fourth.stats.unchanged_bytes >= 4 * BASE and _manifest(tmp_path, 4).depends_on() == {1}
        assert_state_equal(engine.load(step=4), state(4, b0))
