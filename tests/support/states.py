"""States that trip serializers up, and the deep equality tests use to compare a loaded state."""

from __future__ import annotations

import collections
import math
from typing import Any

import numpy as np
import torch


def state_for(step: int, shape: tuple[int, ...] = (64, 64), *, random: bool = False, seed: float = 0.0,
              bias: torch.dtype | None = None, **extra: Any) -> dict[str, Any]:
    """A small training state whose bytes say its step: ``{"w": ..., "step": step, **extra}``.

    Args:
        step: the step; also the generator's seed.
        shape: the shape of ``w``.
        random: ``w`` drawn from a generator seeded by ``step`` (else full of ``step + seed``).
        seed: added to every element of a non-random ``w`` (two runs' states at one step differ).
        bias: a model state instead: ``{"model": {"w": ..., "b": ...}, "step": step, **extra}`` with ``b`` (one
            row of ``w``'s last size, drawn after ``w``) in this dtype.
    """
    g = torch.Generator().manual_seed(step)
    w = torch.randn(shape, generator=g) if random else torch.full(shape, float(step) + seed)
    if bias is None:
        return {"w": w, "step": step, **extra}
    return {"model": {"w": w, "b": torch.randn(shape[-1], generator=g).to(bias)}, "step": step, **extra}


def assert_state_equal(a: Any, b: Any, path: str = "") -> None:
    """Deep equality: same container types, tensors equal in dtype, shape and bytes."""
    assert type(a) is type(b) or (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)), (path, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (path, a.dtype, b.dtype, a.shape, b.shape)
        assert a.device.type == b.device.type, path
        ca, cb = a.detach().cpu().contiguous().reshape(-1), b.detach().cpu().contiguous().reshape(-1)
        assert ca.view(torch.uint8).equal(cb.view(torch.uint8)) if ca.numel() else True, path
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), path
        for k in a:
            assert_state_equal(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_state_equal(x, y, f"{path}/{i}")
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), path
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, path


def awkward_state() -> dict[str, Any]:
    """Every dtype safetensors has, and the shapes, strides and aliasing that trip serializers up."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(8, 6, generator=g)
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
              torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64,
              torch.bool]
    by_dtype = {str(d): (torch.randn(5, 3, generator=g) * 10).to(d) for d in dtypes}
    return {
        "model": collections.OrderedDict(weight=torch.randn(16, 4, generator=g), bias=torch.zeros(16)),
        "dtypes": by_dtype,
        "complex": torch.randn(4, dtype=torch.complex64, generator=g),
        "zero_d": torch.tensor(3.25),
        "empty": torch.empty(0, 7),
        "empty_int": torch.empty(2, 0, dtype=torch.int64),
        "non_contiguous": torch.randn(6, 10, generator=g)[:, ::3],
        "transposed": torch.randn(3, 5, generator=g).t(),
        "views": [base, base[2:5], base.t(), base[:, 1]],
        "tied": {"a": base, "b": base},
        "tuple": (1, 2.5, "three", None, True),
        "optim": {"state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.randn(4, generator=g)}},
                  "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}]},
        "nan": float("nan"),
        "rng": {"numpy": np.random.RandomState(1).get_state(), "torch": torch.get_rng_state()},
        "nested": [[{"deep": (torch.arange(3),)}]],
        "big_int": 2**70,
    }

