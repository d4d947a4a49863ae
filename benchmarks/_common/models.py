"""What the benchmarks train and save, and the small chores around it.

* :func:`accel_model` — the accelerator-like step's model: 4 x Linear with SGD-with-momentum on fixed gradients
  (the device's backward, done); its step is a wait for "device time", then the in-place update on the host.
* :func:`cpu_model` — the CPU-bound step's model: Linear layers and Adam, forward and backward on the host cores.
* :func:`leaves`, :func:`tree_map`, :func:`nbytes`, :func:`differences` — a state's tensors, copied, counted, and
  compared bit for bit with what was loaded back.
* :func:`alternate` — the order of a round of interleaved runs (drift on a shared machine hits every kind alike).
* :func:`median` — of what was measured, ``None`` for nothing; :func:`mean_interval` — how much a few runs say.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def accel_model(width: int, *, layers: int = 4, stepped: bool = True) -> tuple[torch.nn.Module, torch.optim.SGD]:
    """``layers`` x Linear(``width``) and its SGD with momentum on fixed gradients; ``stepped``: stepped once, so
    that the momentum exists."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-6, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    if stepped:
        opt.step()
    return model, opt


def cpu_model(width: int, *, layers: int = 4, batch: int = 64) -> tuple[torch.nn.Module, torch.optim.Adam,
                                                                     Callable[[], None]]:
    """``layers`` x Linear(``width``) + Adam, and its step (forward and backward of a ``batch`` x ``width`` input,
    the update): a CPU-bound training step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(batch, width)

    def step() -> None:
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    return model, opt, step


def training_state(model: torch.nn.Module, opt: torch.optim.Optimizer, **more: Any) -> dict[str, Any]:
    """What a loop saves: ``{"model": ..., "optim": ..., **more}``."""
    return {"model": model.state_dict(), "optim": opt.state_dict(), **more}


def leaves(tree: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` for every tensor in nested mappings, lists and tuples."""
    if isinstance(tree, torch.Tensor):
        yield path, tree
    elif isinstance(tree, Mapping):
        for k, v in tree.items():
            yield from leaves(v, f"{path}/{k}")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from leaves(v, f"{path}/{i}")


def tensors(tree: Any) -> list[torch.Tensor]:
    """Every tensor of ``tree``; a DTensor's local shard."""
    return [t.to_local() if hasattr(t, "to_local") else t for _, t in leaves(tree)]


def nbytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(tree))


def tree_map(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, Mapping):
        return {k: tree_map(fn, v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(tree_map(fn, v) for v in tree)
    return tree


def differences(expected: Any, loaded: Any) -> str:
    """``bit-exact``, or how many of ``expected``'s tensors ``loaded`` lacks or holds other bytes of."""
    got = dict(leaves(loaded))
    bad = []
    for path, want in leaves(expected):
        have = got.get(path)
        if have is None or have.shape != want.shape or have.dtype != want.dtype or not torch.equal(
                have.to(want.device).reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)):
            bad.append(path)
    total = len(list(leaves(expected)))
    return "bit-exact" if not bad else f"TORN: {len(bad)} of {total} tensors differ ({bad[0]})"


def alternate(kinds: Sequence[T], round_no: int, *, first_fixed: bool = False) -> list[T]:
    """``kinds`` in order on even rounds, reversed on odd ones; ``first_fixed``: the first always first (the
    baseline), the rest reversed."""
    if round_no % 2 == 0:
        return list(kinds)
    return [kinds[0], *kinds[:0:-1]] if first_fixed else list(kinds[::-1])


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values that are not ``None``; ``None`` when there are none."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


_T975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}  # Student's t, 97.5%


def mean_interval(ratios: Sequence[float]) -> str:
    """The 95% interval of the mean of per-sequence ratios (Student's t): how much the sequences say."""
    if len(ratios) < 2:
        return "one sequence: no interval"
    mean, half = statistics.mean(ratios), _T975.get(len(ratios) - 1, 2.2) * statistics.stdev(ratios) / len(ratios) ** 0.5
    return f"their mean {mean:.3f}x, 95% interval {mean - half:.2f}-{mean + half:.2f}x"
