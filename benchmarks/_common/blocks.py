"""The interleaved-blocks loop: training steps in blocks of a few, each block with one kind of work beside it (none,
an engine saving continuously, a floor's raw writes), every kind's blocks interleaved in one process, their order
reversed every other round, so a drift of the host (another tenant, the page cache, the CPU's clock) falls on every
kind alike. ``bench_overlap.py`` (its second part), ``bench_cpu_guard.py`` and ``bench_pieces.py`` run it with their
own model, kinds and write sizes.

Per step: ``compute()`` (the device's time: a sleep; or the host's whole step), then the update timed between the
side's :meth:`Beside.before_update` and :meth:`Beside.after_update` (its writes hold off during it), then
:meth:`Beside.after_step` (an engine's ``maybe_save``). Per block: :meth:`Beside.start` before its first step,
:meth:`Beside.stop` after its last (an engine's ``wait()``; a floor's pass in flight finished) — inside the block's
time with ``drain_inside``, outside it otherwise. What saving adds a save is :func:`cost_per_save`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from benchmarks._common.models import alternate


class Beside(Protocol):
    """What runs beside one kind's blocks (the training thread calls every method)."""

    def start(self) -> int:
        """Before a block's first step; the saves (or passes) so far."""
        ...

    def before_update(self) -> None: ...

    def after_update(self) -> None: ...

    def after_step(self, step: int) -> None: ...

    def stop(self) -> int:
        """After a block's last step, once its work is done; the saves (or passes) so far."""
        ...


class Nothing:
    """The baseline: nothing beside the steps."""

    def start(self) -> int:
        return 0

    def before_update(self) -> None:
        pass

    def after_update(self) -> None:
        pass

    def after_step(self, step: int) -> None:
        pass

    def stop(self) -> int:
        return 0


@dataclass
class Saving(Nothing):
    """An engine beside the steps: ``maybe_save(state, step)`` after each (``state=None``: it never saves), with
    ``engine.guard(guard)`` for the block (the optimizer, or ``None``), the block's saves counted by the engine's
    summary key ``count``, ``engine.wait()`` at the block's end. ``in_flight``: asked before each update, its answers
    kept in ``began`` (whether the update began with one of the engine's pwrites in flight)."""

    engine: Any
    state: Callable[[], Any] | None = None
    guard: Any = None
    count: str = "saves"
    in_flight: Callable[[], bool] | None = None
    began: list[bool] = field(default_factory=list)
    _guard: Any = None

    def start(self) -> int:
        self._guard = self.engine.guard(self.guard) if self.guard is not None else None
        return self.engine.summary()[self.count]

    def before_update(self) -> None:
        if self.in_flight is not None:
            self.began.append(self.in_flight())

    def after_step(self, step: int) -> None:
        if self.state is not None:
            self.engine.maybe_save(self.state, step=step)

    def stop(self) -> int:
        self.engine.wait()  # nothing of this block's saves runs into the next block
        if self._guard is not None:
            self._guard.remove()
        return self.engine.summary()[self.count]


class Writes(Nothing):
    """A floor's writes beside the steps (``RawWrites``, a snapshot floor: ``start``, ``before_update``,
    ``after_update``, ``stop``), holding off during each update as the engine's writes do."""

    def __init__(self, floor: Any) -> None:
        self.floor = floor

    def start(self) -> int:
        return self.floor.start()

    def before_update(self) -> None:
        self.floor.before_update()

    def after_update(self) -> None:
        self.floor.after_update()

    def stop(self) -> int:
        return self.floor.stop()


@dataclass(frozen=True)
class Block:
    """One block of steps of one kind."""

    kind: str
    step_s: float  #: the block's time over its steps
    update_s: float  #: the mean update
    update_median_s: float  #: the median update
    done: int  #: the saves (or passes) in the block
    took_s: float  #: the block's time


def run_blocks(beside: dict[str, Beside], *, rounds: int, block: int, compute: Callable[[], None],
               update: Callable[[], None] | None, order: Callable[[int], Sequence[str]] | None = None,
               drain_inside: bool = False, first_step: int = 0) -> list[Block]:
    """Every round, a block of ``block`` steps for each kind of ``beside`` in ``order(round)`` (default: the kinds
    in order, the first always first and the rest reversed every other round; a kind may come more than once); the
    blocks in the order they ran."""
    order = order or (lambda r: alternate(list(beside), r, first_fixed=True))
    runs, step_no = [], first_step
    for round_no in range(rounds):
        for kind in order(round_no):
            side = beside[kind]
            done0 = side.start()
            updates, t0 = [], time.perf_counter()
            for _ in range(block):
                step_no += 1
                compute()
                u0 = time.perf_counter()
                side.before_update()
                if update is not None:
                    update()
                side.after_update()
                updates.append(time.perf_counter() - u0)
                side.after_step(step_no)
            took = time.perf_counter() - t0
            done = side.stop() - done0
            if drain_inside:
                took = time.perf_counter() - t0
            runs.append(Block(kind, took / block, sum(updates) / block, statistics.median(updates), done, took))
    return runs


def by_kind(runs: Sequence[Block]) -> dict[str, list[Block]]:
    """The blocks of each kind, in the order they ran."""
    found: dict[str, list[Block]] = {}
    for b in runs:
        found.setdefault(b.kind, []).append(b)
    return found


def cost_per_save(runs: Sequence[Block], kind: str, baseline: str, block: int) -> float | None:
    """C, what ``kind``'s saves add a save: (its step - the baseline's step of the same round) x steps / saves, the
    median over the rounds with a save (``None``: none)."""
    kinds = by_kind(runs)
    per = [(r.step_s - b.step_s) * block / r.done for r, b in zip(kinds[kind], kinds[baseline]) if r.done]
    return statistics.median(per) if per else None
