"""Saves of a state of the same structure reuse its shard layout (planning/save.py: PlanCache); the
checkpoint is the same as without the cache, and any change of structure lays the file out again."""

from __future__ import annotations

import torch

from persist_core import CheckpointEngine
from tests.support.states import assert_state_equal


def _state(step: int, *, rows: int = 8, note: object = None) -> dict:
    g = torch.Generator().manual_seed(step)
    weight = torch.randn(rows, 6, generator=g)
    return {"model": {"w": weight, "w_t": weight.t(), "tied": weight[2:],  # one storage, three views
                      "b": torch.randn(6, generator=g).to(torch.bfloat16)},
            "optim": {"state": {0: {"exp_avg": torch.randn(rows, 6, generator=g), "step": torch.tensor(float(step))}},
                      "param_groups": [{"lr": 0.1 / step, "betas": (0.9, 0.999)}]},
            "note": note if note is not None else complex(step, 1),  # pickled: an object leaf
            "step": step}


def test_same_structure_reuses_the_layout_and_every_checkpoint_is_exact(tmp_path):
    with CheckpointEngine(tmp_path) as engine:
        for step in range(1, 6):
            engine.save(_state(step), step=step)
        assert (engine._parts.saver._plans.hits, engine._parts.saver._plans.misses) == (4, 1)
        engine.save(_state(6, rows=9), step=6)  # a resized tensor
        engine.save(_state(7, rows=9, note={7, 8, 9}), step=7)  # a pickled leaf of another length
        engine.save({**_state(8, rows=9, note={7, 8, 9}), "extra": torch.ones(2)}, step=8)  # a new key
        assert (engine._parts.saver._plans.hits, engine._parts.saver._plans.misses) == (4, 4)
        engine.wait()
        for step in range(1, 9):
            loaded = engine.load(step)
            expected = _state(step, rows=8 if step < 6 else 9, note=None if step < 7 else {7, 8, 9})
            if step == 8:
                expected["extra"] = torch.ones(2)
            assert_state_equal(loaded, expected)
            assert loaded["model"]["tied"].untyped_storage().data_ptr() == loaded["model"]["w"].untyped_storage().data_ptr()


def test_a_guarded_save_through_the_cache_copies_the_new_state_not_the_old(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    expected = {}
    with CheckpointEngine(tmp_path) as engine, engine.guard(opt):
        for step in range(1, 5):
            model(torch.randn(3, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            expected[step] = type(model.state_dict())((k, v.clone()) for k, v in model.state_dict().items())
            engine.save({"model": model.state_dict(), "optim": opt.state_dict()}, step=step)
        engine.wait()
        assert engine._parts.saver._plans.hits >= 2  # the momentum buffers appear after the first step's save
        for step, weights in expected.items():
            assert_state_equal(engine.load(step)["model"], weights)
