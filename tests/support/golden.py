"""The state behind tests/golden/v1-*: every kind of leaf, written by the v1 engine before the restructuring."""

import collections
import torch
def golden_state():
    g = torch.Generator().manual_seed(7)
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "model": collections.OrderedDict(weight=torch.randn(8, 4, generator=g), bias=torch.zeros(8, dtype=torch.bfloat16)),
        "tied": {"a": base, "b": base, "view": base[1:3, ::2]},
        "ints": torch.arange(5, dtype=torch.int64),
        "flags": torch.tensor([True, False]),
        "empty": torch.empty(0, 3),
        "step": 12, "lr": 0.5, "name": "golden", "none": None, "tuple": (1, 2.5, "x"),
        "nested": [[{"deep": (torch.ones(2, 2, dtype=torch.float16),)}]],
    }
