"""The encoding of a state's tree: nested containers to JSON for the manifest, and back.

:func:`flatten` takes a state apart into a JSON-able tree (dict / OrderedDict / list / tuple and
JSON scalars), its tensors in tree order, and its other leaves pickled at once (so a later
mutation cannot leak into the checkpoint); :func:`unflatten` rebuilds the same object.
"""

from __future__ import annotations

import pickle
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from persist_core.errors import CorruptCheckpointError, UnsupportedStateError


@dataclass(frozen=True)
class FlatState:
    """A state taken apart: a JSON-able tree, its tensors (in tree order) and pickled leaves."""

    tree: Any
    tensors: list[tuple[str, torch.Tensor]]
    objects: list[bytes]


def _check_tensor(t: torch.Tensor, path: str) -> None:
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise UnsupportedStateError(
            f"state[{path!r}] is a {type(t).__name__}, a tensor subclass torch-persist cannot snapshot; "
            "save a plain tensor (e.g. DTensor.full_tensor() or .to_local())"
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

    def enc(obj: Any, path: str) -> Any:
        kind = type(obj)
        if isinstance(obj, torch.Tensor):
            _check_tensor(obj, path)
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
        try:
            objects.append(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception as e:  # pickle raises many types: PicklingError, TypeError, AttributeError
            raise UnsupportedStateError(
                f"state[{path!r}] ({kind.__module__}.{kind.__qualname__}) cannot be saved: {e}. "
                "Keep tensors, dicts, lists, tuples and picklable values in the state, "
                "or convert this value before saving"
            ) from e
        return {"object": len(objects) - 1}

    tree = enc(state, "")
    return FlatState(tree=tree, tensors=tensors, objects=objects)


def unflatten(tree: Any, tensors: list[torch.Tensor], objects: list[Any]) -> Any:
    """Rebuild the state from :func:`flatten`'s tree, loaded tensors and unpickled objects."""

    def dec(node: Any) -> Any:
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

    return dec(tree)

