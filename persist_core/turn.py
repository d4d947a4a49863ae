"""``Turn``: whose turn the host is — the training's while a guarded update runs, the background I/O's
otherwise. One object per engine, handed at construction to the few executors that run background I/O
(the writer's threads, the upload threads, the staging warm-up, local retention's deletes); each calls
:meth:`Turn.wait` before a piece of host work. :data:`NO_TURN` is the null one (no guard ever holds it):
what a tier or pool built outside an engine (the CLI, a reader) gets."""

from __future__ import annotations

import threading
import time

from persist_core.fileio import YIELD_PIECE_BYTES


class Turn:
    """Held by a guarded update (:meth:`hold` to :meth:`release`); background I/O :meth:`wait` s before each piece.
    A hold that is never released (an update that raised before its post-hook) ends by itself after ``max_hold_s``.
    ``guarded`` (set by the overlap while a guard is on): updates may hold the writes, which then go in pieces of
    :meth:`piece_bytes` so that a hold stops the next one."""

    def __init__(self, max_hold_s: float = 1.0) -> None:
        self._open = threading.Event()
        self._open.set()
        self._until = 0.0
        self.max_hold_s = max_hold_s
        self.held_s = 0.0  # total time the background I/O waited for updates (the price in D of not slowing them)
        self._held_lock = threading.Lock()  # several writer threads add to held_s
        self.guarded = False

    def hold(self) -> None:
        self._until = time.monotonic() + self.max_hold_s
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def wait(self) -> None:
        if self._open.is_set():
            return
        t0 = time.monotonic()
        left = self._until - t0
        if left > 0:
            self._open.wait(left)
        with self._held_lock:
            self.held_s += time.monotonic() - t0

    def piece_bytes(self) -> int | None:
        """The pwrite size of writes that yield (a guard is on), else ``None`` (a chunk in one pwrite)."""
        return YIELD_PIECE_BYTES if self.guarded else None


class NoTurn(Turn):
    """The null turn: never held, never guarded."""

    def hold(self) -> None:
        pass

    def wait(self) -> None:
        pass


NO_TURN = NoTurn()
