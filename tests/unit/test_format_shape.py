"""A state of a structure seen before is taken apart by its learned Shape, with exactly flatten's result; any
other state is a mismatch (then flattened as before)."""

from __future__ import annotations

import json
from collections import OrderedDict

import pytest
import torch

from persist_core import CheckpointEngine, PerRank
from persist_core.errors import UnsupportedStateError
from persist_core.format.shape import Shape
from persist_core.format.tree import flatten
from persist_core.planning.save import PlanCache
from tests.support.states import assert_state_equal


class Opaque:
    def __init__(self, x):
        self.x = x


def make(step=7, lr=0.1, extra=None):
    torch.manual_seed(step)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step, "lr": lr, "flag": True,
             "none": None, "name": "run", "ordered": OrderedDict([("b", torch.zeros(2)), ("a", 1)]),
             "tuple": (1, 2.5, "x", torch.arange(3)), "ints": [1, 2, 3], "obj": Opaque(step),
             "rng": PerRank(torch.get_rng_state()[:16]), 3: "int key", None: "none key", 2.5: [torch.ones(1)]}
    if extra:
        state.update(extra)
    return state


def same(a, b) -> None:
    """Two FlatStates are equal: the tree (as the manifest writes it), the tensors (the same objects), the
    pickled leaves."""
    assert json.dumps(a.tree) == json.dumps(b.tree)
    assert [p for p, _ in a.tensors] == [p for p, _ in b.tensors]
    assert all(x is y for (_, x), (_, y) in zip(a.tensors, b.tensors))
    assert a.objects == b.objects and a.per_rank == b.per_rank


def test_a_state_of_the_learned_structure_is_taken_apart_as_flatten_would():
    shape = Shape.learn(flatten(make()))
    assert shape is not None
    for state in (make(), make(step=8, lr=0.2), make(step=9, lr=-0.0)):  # new values, new tensors
        taken = shape.take(state)
        assert taken is not None
        same(taken, flatten(state))


@pytest.mark.parametrize("change", [
    lambda s: s.update({"new": 1}),  # a key more
    lambda s: s.pop("name"),  # a key less
    lambda s: s.update({"step": torch.tensor(7)}),  # a tensor where a value was
    lambda s: s.update({"lr": {"a": 1}}),  # a dict where a value was
    lambda s: s.update({"obj": 5}),  # a value where an object was
    lambda s: s.update({"obj": torch.zeros(1)}),  # a tensor where an object was
    lambda s: s.update({"rng": 3}),  # not a PerRank any more
    lambda s: s.update({"ints": (1, 2, 3)}),  # a tuple where a list was
    lambda s: s.update({"ints": [1, 2]}),  # shorter
    lambda s: s.update({"ordered": dict(s["ordered"])}),  # a dict where an OrderedDict was
    lambda s: s["model"].move_to_end("0.weight"),  # keys in another order
    lambda s: s["model"].update({"0.weight": torch.ones(2, dtype=torch.cfloat).conj()}),  # a view flatten resolves
    lambda s: s["model"].update({"0.weight": torch.nn.Parameter(s["model"]["0.weight"])}),  # another tensor type
    lambda s: s["model"].update({"0.bias": s["model"]["0.bias"].to_sparse()}),  # no dense bytes
    lambda s: s.update({3.0: s.pop(3)}),  # a key equal to the learned one, of another type
])
def test_any_other_structure_is_a_mismatch(change):
    shape = Shape.learn(flatten(make()))
    state = make()
    change(state)
    assert shape.take(state) is None


def test_int_and_bool_values_keep_their_types():
    shape = Shape.learn(flatten({"a": 1, "b": [True, 2]}))
    taken = shape.take({"a": True, "b": [1, 2]})
    assert json.dumps(taken.tree) == json.dumps(flatten({"a": True, "b": [1, 2]}).tree)


def test_a_leaf_that_cannot_be_pickled_raises_as_flatten_does():
    shape = Shape.learn(flatten(make()))
    state = make(extra=None)
    state["obj"] = Opaque(lambda: None)  # a lambda cannot be pickled
    with pytest.raises(UnsupportedStateError, match="obj"):
        shape.take(state)


def test_a_pickled_key_is_not_matched():
    assert Shape.learn(flatten({(1, 2): torch.zeros(1)})) is None


def test_saves_of_one_structure_are_taken_apart_by_the_shape_and_load_back(tmp_path):
    cache = PlanCache()
    with CheckpointEngine(tmp_path) as engine:
        engine._parts.saver._plans = cache
        for step in (1, 2, 3):
            state = make(step=step, lr=0.1 * step)
            engine.save(state, step=step).wait()
            assert_state_equal({k: v for k, v in engine.load(step, weights_only=False).items() if k not in ("obj", "rng")},
                               {k: v for k, v in state.items() if k not in ("obj", "rng")})
        assert cache.shape is not None and cache.hits == 2
        engine.save(make(step=4, extra={"more": 1}), step=4).wait()  # another structure: flattened, learned anew
        assert engine.load(4, weights_only=False)["more"] == 1
        assert cache.shape.take(make(step=5, extra={"more": 2})) is not None
