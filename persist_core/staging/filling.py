"""How far a copy has filled a staging buffer: the copy thread says :meth:`Filling.reached` and
:meth:`Filling.finish`; a reader of the buffer (the memory tier's checksums) waits until each block is
:meth:`Filling.passed`. :func:`followed` runs a deferred copy telling a ``Filling`` how it goes.

Shared by the save flow (a guarded save's copy thread) and the memory tier (its snapshots' checksums)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future


class Filling:
    """How far a guarded snapshot's copy has filled its slot: the copy thread says :meth:`reached` and
    :meth:`finish`; the snapshots' thread checksums each block once it is :meth:`passed`."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._end = 0
        self._done: bool | None = None  # copied whole (True), failed (False), still copying (None)
        self.sums: Future[list[int] | None]

    def reached(self, end: int) -> None:
        with self._cond:
            self._end = max(self._end, end)
            self._cond.notify_all()

    def finish(self, ok: bool) -> None:
        with self._cond:
            self._done = ok
            self._cond.notify_all()

    def passed(self, end: int) -> bool:
        """Whether bytes ``[0, end)`` are final (waits for the copy to get there); ``False``: it failed first."""
        with self._cond:
            self._cond.wait_for(lambda: self._end >= end or self._done is not None)
            return self._done is not False


def followed(copy: Callable[..., float], filling: Filling | None) -> float:
    """``copy()`` (a guarded save's deferred copies), telling ``filling`` how far it got and how it ended."""
    if filling is None:
        return copy()
    try:
        behind = copy(progress=filling.reached)
    except BaseException:
        filling.finish(False)
        raise
    filling.finish(True)
    return behind
