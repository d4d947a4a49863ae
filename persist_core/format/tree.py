"""The encoding of a state's tree: nested containers to JSON for the manifest, and back.

:func:`flatten` takes a state apart into a JSON-able tree (dict / OrderedDict / list / tuple and
JSON scalars), its tensors in tree order, and its other leaves pickled at once (so a later
mutation cannot leak into the checkpoint); :func:`unflatten` rebuilds the same object.
"""

from __future__ import annotations

import io
import logging
import pickle
import sys
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from persist_core.errors import ConfigError, CorruptCheckpointError, UnsafeCheckpointError, UnsupportedStateError

log = logging.getLogger(__name__)


class PickledLeafWarning(UserWarning):
    """A value of the state saves, but loading it back needs ``weights_only=False`` (full pickle)."""


#: ``(key path, type)`` of the pickled leaves checked already: a verdict each, once per process
_CHECKED: set[tuple[str, type]] = set()
_CHECKED_LOCK = threading.Lock()


@dataclass(frozen=True)
class PerRank:
    """A value that differs from rank to rank on purpose (an RNG state, a per-rank data loader position).

    ``engine.save({"rng": PerRank(torch.get_rng_state()), ...})``: every rank saves its own value
    (pickled, tensors and all) and a load returns to each rank the value that rank saved — the
    value itself, not the wrapper. A rank the checkpoint had no such rank for (a job resumed on
    more ranks than saved it) gets ``None`` and a warning; a load in one process gets rank 0's.
    Without the wrapper a plain tensor on several ranks is taken to be replicated, and checked.
    """

    value: Any


@dataclass(frozen=True)
class FlatState:
    """A state taken apart: a JSON-able tree, its tensors (in tree order) and pickled leaves.

    ``tensors`` may hold ``DTensor`` leaves (sharded: :mod:`persist_core.planning.sharding` takes
    them apart); ``per_rank`` holds the pickled values of :class:`PerRank` leaves, this rank's.
    """

    tree: Any
    tensors: list[tuple[str, torch.Tensor]]
    objects: list[bytes]
    per_rank: list[bytes] = field(default_factory=list)


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (without importing torch.distributed)."""
    kind = type(t)
    return kind.__name__ == "DTensor" and kind.__module__.startswith("torch.distributed")


def _check_tensor(t: torch.Tensor, path: str) -> None:
    if is_dtensor(t):
        return
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise UnsupportedStateError(
            f"state[{path!r}] is a {type(t).__name__}, a tensor subclass torch-persist cannot snapshot; "
            "save a plain tensor (or a DTensor, which is saved sharded)"
        )
    if t.layout != torch.strided or t.is_quantized or t.is_nested or t.is_meta:
        raise UnsupportedStateError(
            f"state[{path!r}] is a {t.layout} / quantized / nested / meta tensor, which has no dense bytes "
            "to write; convert it (e.g. .to_dense(), .dequantize()) before saving"
        )


def _join(path: str, key: Any) -> str:
    return f"{path}/{key}" if path else str(key)


def flatten(state: Any) -> FlatState:
    """Take ``state`` apart; non-JSON leaves are pickled now, so later mutation cannot leak in.

    Raises:
        UnsupportedStateError: a leaf cannot be saved; the message names its key path.
    """
    tensors: list[tuple[str, torch.Tensor]] = []
    objects: list[bytes] = []
    per_rank: list[bytes] = []

    def enc(obj: Any, path: str) -> Any:
        kind = type(obj)
        if kind is PerRank:
            per_rank.append(pickle_per_rank(obj.value, path))
            return {"per_rank": len(per_rank) - 1}
        if isinstance(obj, torch.Tensor):
            _check_tensor(obj, path)
            if not is_dtensor(obj) and (obj.is_conj() or obj.is_neg()):  # a lazy view: its bytes are not its values
                obj = obj.resolve_conj().resolve_neg()  # saved as its own copy (it no longer aliases its base)
            tensors.append((path, obj))
            return {"tensor": len(tensors) - 1}
        if obj is None or kind in (bool, int, float, str):
            return {"value": obj}
        if kind is dict or kind is OrderedDict:
            items = [[enc(k, _join(path, "<key>")), enc(v, _join(path, k))] for k, v in obj.items()]
            return {"dict": items, "ordered": kind is OrderedDict}
        if kind is list:
            return {"list": [enc(v, _join(path, i)) for i, v in enumerate(obj)]}
        if kind is tuple:
            return {"tuple": [enc(v, _join(path, i)) for i, v in enumerate(obj)]}
        objects.append(_pickle(obj, path))
        return {"object": len(objects) - 1}

    try:
        tree = enc(state, "")
    except RecursionError:
        raise UnsupportedStateError(
            "the state nests dicts/lists/tuples deeper than Python's recursion limit "
            f"({sys.getrecursionlimit()}), or contains itself; flatten it before saving") from None
    return FlatState(tree=tree, tensors=tensors, objects=objects, per_rank=per_rank)


def _pickle(obj: Any, path: str) -> bytes:
    try:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # pickle raises many types: PicklingError, TypeError, AttributeError
        kind = type(obj)
        raise UnsupportedStateError(
            f"state[{path!r}] ({kind.__module__}.{kind.__qualname__}) cannot be saved: {e}. "
            "Keep tensors, dicts, lists, tuples and picklable values in the state, "
            "or convert this value before saving"
        ) from e
    _check_loadable(data, obj, path)
    return data


def _check_loadable(data: bytes, obj: Any, path: str) -> None:
    """Warn once per key path (and type) when a leaf saves but will not load with the default
    ``weights_only=True``: a dataclass, a custom class. Found at ``save()``, not at the resume."""
    key = (path, type(obj))
    with _CHECKED_LOCK:
        if key in _CHECKED:
            return
        _CHECKED.add(key)
    from persist_core.format.unpickle import loads

    try:
        loads(data, where=f"state[{path!r}]")
    except UnsafeCheckpointError as e:
        kind = type(obj)
        text = (f"state[{path!r}] ({kind.__module__}.{kind.__qualname__}) is saved pickled, and loading it back will "
                f"need weights_only=False (full pickle, for checkpoints you trust): {e}. To resume with the default, "
                "save it as plain data (a dict of numbers and strings, e.g. dataclasses.asdict(value))")
        log.warning("%s", text)
        warnings.warn(text, PickledLeafWarning, stacklevel=2)
    except CorruptCheckpointError:
        pass  # a value whose pickle does not load back at all: its load says so


class _PerRankPickler(pickle.Pickler):
    """Pickles a PerRank's value, refusing a PerRank inside it: a load would have to unpickle the wrapper."""

    def reducer_override(self, obj: Any) -> Any:  # not called for plain ints, strs, dicts, lists...: cheap
        if type(obj) is PerRank:
            raise _NestedPerRank
        return NotImplemented


class _NestedPerRank(Exception):
    pass


def pickle_per_rank(value: Any, path: str) -> bytes:
    """``value`` (a :class:`PerRank`'s) pickled.

    Raises:
        ConfigError: ``value`` holds another PerRank (it commits, and then no load could return it).
        UnsupportedStateError: ``value`` cannot be pickled.
    """
    out = io.BytesIO()
    try:
        _PerRankPickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    except _NestedPerRank:
        raise ConfigError(f"state[{path!r}] is a PerRank holding another PerRank; wrap each per-rank value once: "
                          "{'rng': PerRank(value)}, not PerRank(PerRank(value)) nor PerRank({'k': PerRank(...)})"
                          ) from None
    except Exception:
        return _pickle(value, path)  # the same failure, with the message every leaf gets
    data = out.getvalue()
    _check_loadable(data, value, path)
    return data


def tensor_paths(tree: Any, objects: list[Any] | None = None) -> list[str]:
    """The key path of each tensor of a manifest's ``tree``, in tensor order (the paths :func:`flatten`
    named them by: ``model/layer.weight``). A key that was pickled is named by its value when
    ``objects`` (the unpickled leaves) are given, else ``<key>``."""
    paths: list[str] = []

    def key(node: Any) -> Any:
        if "value" in node:
            return node["value"]
        if "object" in node and objects is not None:
            return objects[node["object"]]
        return "<key>"

    def walk(node: Any, path: str) -> None:
        if "tensor" in node:
            paths.append(path)
        elif "dict" in node:
            for k, v in node["dict"]:
                walk(v, _join(path, key(k)))
        elif "list" in node or "tuple" in node:
            for i, v in enumerate(node.get("list", node.get("tuple"))):
                walk(v, _join(path, i))

    walk(tree, "")
    return paths


def unflatten(tree: Any, tensors: list[torch.Tensor], objects: list[Any], per_rank: list[Any] | None = None) -> Any:
    """Rebuild the state from :func:`flatten`'s tree, loaded tensors, unpickled objects and this rank's
    :class:`PerRank` values (``None`` where this rank has none)."""

    def dec(node: Any) -> Any:
        if "per_rank" in node:
            return None if per_rank is None else per_rank[node["per_rank"]]
        if "tensor" in node:
            return tensors[node["tensor"]]
        if "value" in node:
            return node["value"]
        if "dict" in node:
            pairs = ((dec(k), dec(v)) for k, v in node["dict"])
            return OrderedDict(pairs) if node.get("ordered") else dict(pairs)
        if "list" in node:
            return [dec(v) for v in node["list"]]
        if "tuple" in node:
            return tuple(dec(v) for v in node["tuple"])
        if "object" in node:
            return objects[node["object"]]
        raise CorruptCheckpointError(f"unknown node {sorted(node)} in the manifest's tree")

    try:
        return dec(tree)
    except RecursionError:
        raise CorruptCheckpointError(f"the manifest's tree nests deeper than Python's recursion limit "
                                     f"({sys.getrecursionlimit()}) allows here") from None

