"""Unpickling a checkpoint's non-tensor leaves without running code the checkpoint chose.

Every pickled leaf (hyper-parameters, loop state, RNG states) is read by :func:`loads`: by default
(``weights_only=True``, as ``torch.load`` spells it) with an unpickler whose ``find_class`` allows
only the types training states hold — containers, numbers, strings, ``torch.Size``/dtypes/devices,
tensors, numpy arrays and scalars (numpy's RNG state), ``argparse.Namespace``, Lightning's
``AttributeDict`` — and that reads every pickle protocol (our leaves are pickled with protocol 5,
which torch's own restricted unpickler refuses; version 1 checkpoints must keep loading). A tensor
inside a leaf comes back through ``torch.load(..., weights_only=True)``, never torch's
full-pickle ``_load_from_bytes``. Nothing process-wide changes (torch's safe globals stay as they
are). ``weights_only=False`` is full pickle: for checkpoints you trust.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from persist_core.errors import CorruptCheckpointError, UnsafeCheckpointError

#: ``(module, name)`` a leaf may name; modules whose every member is a dtype-like constant are below
_ALLOWED: frozenset[tuple[str, str]] = frozenset({
    *(("builtins", n) for n in ("dict", "list", "tuple", "set", "frozenset", "int", "float", "complex", "bool",
                                "str", "bytes", "bytearray", "slice", "range")),
    *(("collections", n) for n in ("OrderedDict", "defaultdict", "deque", "Counter")),
    ("torch", "Size"), ("torch", "device"), ("torch", "dtype"), ("torch", "Generator"),
    ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_parameter"),
    ("torch._utils", "_rebuild_tensor_v3"), ("torch._utils", "_rebuild_parameter_with_state"),
    ("numpy", "dtype"), ("numpy", "ndarray"),
    ("numpy._core.numeric", "_frombuffer"), ("numpy.core.numeric", "_frombuffer"),
    ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "scalar"), ("numpy.core.multiarray", "scalar"),
    ("argparse", "Namespace"), ("datetime", "datetime"), ("datetime", "timedelta"), ("datetime", "date"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("lightning.fabric.utilities.data", "AttributeDict"), ("lightning_fabric.utilities.data", "AttributeDict"),
    ("pytorch_lightning.utilities.parsing", "AttributeDict"), ("lightning.pytorch.utilities.parsing", "AttributeDict"),
})
_NUMPY_DTYPE_CLASSES = ("numpy.dtypes",)


def _load_storage(data: bytes) -> Any:
    """What ``torch.storage._load_from_bytes`` does, without full pickle: the bytes are ``torch.save`` of a storage."""
    import torch

    return torch.load(io.BytesIO(data), weights_only=True)


class _Restricted(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _load_storage
        if (module, name) in _ALLOWED or module in _NUMPY_DTYPE_CLASSES or _is_torch_dtype(module, name):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"a leaf of this checkpoint names {module}.{name}, which loading with weights_only=True does not run: "
            "if you trust the checkpoint, load it with weights_only=False (engine.load / CheckpointReader.load / "
            "the adapters' load; `persist export|inspect --unsafe-pickle`), or save that value as plain data")


def _is_torch_dtype(module: str, name: str) -> bool:
    if module != "torch":
        return False
    import torch

    return isinstance(getattr(torch, name, None), torch.dtype)


def loads(data: bytes | memoryview, *, weights_only: bool = True, where: str = "a checkpoint") -> Any:
    """Unpickle one leaf: restricted (the default) or, with ``weights_only=False``, full pickle.

    Raises:
        UnsafeCheckpointError: (restricted) the leaf names a type outside the allowlist; the message
            names it and the opt-in.
        CorruptCheckpointError: the bytes do not unpickle.
    """
    try:
        if not weights_only:
            return pickle.loads(data)
        return _Restricted(io.BytesIO(bytes(data))).load()
    except UnsafeCheckpointError as e:
        raise UnsafeCheckpointError(f"{where}: {e}") from None
    except Exception as e:  # whatever damaged bytes make the unpickler raise
        raise CorruptCheckpointError(f"{where}: a pickled leaf does not load ({type(e).__name__}: {e})") from e


def allowed() -> list[str]:
    """The ``module.name`` list restricted loading allows (for documentation and error messages)."""
    return sorted(f"{m}.{n}" for m, n in _ALLOWED)

