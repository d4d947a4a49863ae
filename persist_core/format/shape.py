"""Taking apart again a state of a structure seen before, without flattening it node by node.

:func:`~persist_core.format.tree.flatten` walks any state and builds its tree one node at a time (about
2 us a node here: 8 ms for the 1,536 tensors of a 384-parameter model with AdamW, which a guarded save
otherwise stalls training for). A training job saves states of one structure, so the plan cache keeps a
:class:`Shape` learned from the last flatten: a matcher that checks that the next state has exactly that
structure — container types, dict keys and their types, lengths, each leaf's kind and tensor type — and
takes its leaves out in the same order, reusing the learned tree's nodes wherever nothing changed (only
JSON values can change: a ``step``, a learning rate). A dict or list of tensors only is checked and taken
in a few C-level calls. Anything else — a key more, a tensor where a value was, a view that flatten would
resolve (conjugate, negative), a sparse or meta tensor — is a mismatch: :meth:`Shape.take` returns ``None``
and the caller flattens as before. What it returns equals what ``flatten`` returns for the same state.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from persist_core.format.tree import FlatState, PerRank, _join, _pickle, is_dtensor, pickle_per_rank


class _Mismatch(Exception):
    """The state is not of the learned structure."""


class _Unsupported(Exception):
    """The structure has something a shape does not match (a key that is not a JSON value)."""


_SCALARS = frozenset((bool, int, float, str, type(None)))
_NOT_OBJECTS = _SCALARS | {dict, OrderedDict, list, tuple, PerRank}
_STRIDED = torch.strided


def plain_tensor(t: torch.Tensor) -> bool:
    """What flatten would save as it is (no view to resolve, dense bytes): its memory holds its values."""
    return (t.layout is _STRIDED and not (t.is_quantized or t.is_nested or t.is_meta or t.is_conj() or t.is_neg()))


class _Out:
    __slots__ = ("tensors", "objects", "per_rank")

    def __init__(self) -> None:
        self.tensors: list[tuple[str, torch.Tensor]] = []
        self.objects: list[bytes] = []
        self.per_rank: list[bytes] = []


Take = Callable[[Any, _Out], Any]


class Shape:
    """A state structure, learned from one :class:`FlatState`; :meth:`take` takes the next state of it apart."""

    def __init__(self, flat: FlatState) -> None:
        self._flat = flat  # only during compiling: the tensors' paths and types
        try:
            self._take = self._compile(flat.tree, "")
        finally:
            del self._flat

    @classmethod
    def learn(cls, flat: FlatState) -> Shape | None:
        """The shape of ``flat``'s state, or ``None`` where it has a dict key that is not a JSON value."""
        try:
            return cls(flat)
        except _Unsupported:
            return None

    def take(self, state: Any) -> FlatState | None:
        """``flatten(state)`` for a state of this structure; ``None`` for any other (then flatten it).

        Raises:
            UnsupportedStateError: a leaf cannot be pickled (as flatten raises it).
        """
        out = _Out()
        try:
            tree = self._take(state, out)
        except _Mismatch:
            return None
        return FlatState(tree=tree, tensors=out.tensors, objects=out.objects, per_rank=out.per_rank)

    # ------------------------------------------------------------------ compiling

    def _compile(self, node: dict[str, Any], path: str) -> Take:
        if "tensor" in node:
            return self._tensor(node, path)
        if "value" in node:
            return _value(node)
        if "object" in node:
            return _object(node, path)
        if "per_rank" in node:
            return _per_rank(node, path)
        if "dict" in node:
            return self._dict(node, path)
        kind = list if "list" in node else tuple
        return self._sequence(node, kind, path)

    def _tensor(self, node: dict[str, Any], path: str) -> Take:
        kind = type(self._flat.tensors[node["tensor"]][1])
        check = not is_dtensor(self._flat.tensors[node["tensor"]][1])

        def take(obj: Any, out: _Out) -> Any:
            if type(obj) is not kind or (check and not plain_tensor(obj)):
                raise _Mismatch
            out.tensors.append((path, obj))
            return node
        return take

    def _leaves(self, nodes: list[dict[str, Any]], paths: list[str]) -> Callable[[list[Any], _Out], bool] | None:
        """For children that are all tensors: one check and one extend for all of them."""
        if not nodes or not all("tensor" in n for n in nodes):
            return None
        samples = [self._flat.tensors[n["tensor"]][1] for n in nodes]
        kinds = [type(t) for t in samples]
        check = not any(is_dtensor(t) for t in samples)

        def take(values: list[Any], out: _Out) -> bool:
            if list(map(type, values)) != kinds or (check and not all(map(plain_tensor, values))):
                return False
            out.tensors.extend(zip(paths, values))
            return True
        return take

    def _dict(self, node: dict[str, Any], path: str) -> Take:
        kind = OrderedDict if node["ordered"] else dict
        items = node["dict"]
        if not all("value" in k for k, _ in items):
            raise _Unsupported  # a pickled key: compared by value it might match where flatten differs
        keys = [k["value"] for k, _ in items]
        key_types = list(map(type, keys))
        paths = [_join(path, k) for k in keys]
        children = [v for _, v in items]
        leaves = self._leaves(children, paths)
        takes = None if leaves is not None else [self._compile(v, p) for v, p in zip(children, paths)]
        ordered = node["ordered"]

        def take(obj: Any, out: _Out) -> Any:
            if type(obj) is not kind or len(obj) != len(keys) or list(obj) != keys or list(map(type, obj)) != key_types:
                raise _Mismatch
            if leaves is not None:
                if not leaves(list(obj.values()), out):
                    raise _Mismatch
                return node
            assert takes is not None
            new = [t(v, out) for t, v in zip(takes, obj.values())]
            if all(a is b for a, b in zip(new, children)):
                return node
            return {"dict": [[k, v] for (k, _), v in zip(items, new)], "ordered": ordered}
        return take

    def _sequence(self, node: dict[str, Any], kind: type, path: str) -> Take:
        name = "list" if kind is list else "tuple"
        children = node[name]
        n = len(children)
        paths = [_join(path, i) for i in range(n)]
        leaves = self._leaves(children, paths)
        values = [c["value"] for c in children] if all("value" in c for c in children) else None
        value_types = None if values is None else list(map(type, values))
        if value_types is not None and float in value_types:
            values = value_types = None  # floats are compared one by one (see _value)
        takes = None if leaves is not None else [self._compile(c, p) for c, p in zip(children, paths)]

        def take(obj: Any, out: _Out) -> Any:
            if type(obj) is not kind or len(obj) != n:
                raise _Mismatch
            if leaves is not None:
                if not leaves(list(obj), out):
                    raise _Mismatch
                return node
            if values is not None and list(map(type, obj)) == value_types and list(obj) == values:
                return node  # a list of the same values (a param group's "params"): nothing to take
            assert takes is not None
            new = [t(v, out) for t, v in zip(takes, obj)]
            if all(a is b for a, b in zip(new, children)):
                return node
            return {name: new}
        return take


def _value(node: dict[str, Any]) -> Take:
    learned = node["value"]
    kind = None if type(learned) is float else type(learned)  # a float node is never reused: -0.0 == 0.0, nan

    def take(obj: Any, out: _Out) -> Any:
        k = type(obj)
        if k is kind and obj == learned:
            return node
        if k in _SCALARS:
            return {"value": obj}
        raise _Mismatch
    return take


def _object(node: dict[str, Any], path: str) -> Take:
    def take(obj: Any, out: _Out) -> Any:
        if type(obj) in _NOT_OBJECTS or isinstance(obj, torch.Tensor):
            raise _Mismatch
        out.objects.append(_pickle(obj, path))
        return node
    return take


def _per_rank(node: dict[str, Any], path: str) -> Take:
    def take(obj: Any, out: _Out) -> Any:
        if type(obj) is not PerRank:
            raise _Mismatch
        out.per_rank.append(pickle_per_rank(obj.value, path))
        return node
    return take
