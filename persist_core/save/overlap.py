"""Overlapped snapshots (FastPersist's overlap): ``save()`` returns before the parameters are copied.

With a guard (:meth:`CheckpointEngine.guard`), ``save()`` copies at once only what the forward
pass itself may mutate — everything that is not a parameter or optimizer state of the guarded
optimizers (module buffers such as BatchNorm's running statistics, step counters, RNG states) —
and hands the copy of the parameters and optimizer state to one background thread, which then
submits the write. The next ``optimizer.step()`` — the first thing that mutates them — waits for
that copy: the guard is an ``optimizer.register_step_pre_hook``. So the checkpoint is the state
at the moment of ``save()`` while the next forward and backward run.

While a guarded update runs, the background writes hold off (:class:`Turn`): from the fence to the
optimizer's step post-hook, the writer threads checksum and write nothing, so the update has the
host's cores to itself. The writes' host work (a crc32c of every byte, and the copy into the page
cache where ``O_DIRECT`` is refused) then runs while the host waits for the device — or, in a
CPU-bound loop, during the forward and backward — instead of slowing the update; ``O_DIRECT`` writes
already in flight are the disk's DMA and go on.

Who calls what: the engine calls :meth:`Overlap.deferral` and :meth:`Overlap.run` from ``save()``
(the copy thread then runs :meth:`~persist_core.save.writer.Writer.submit_after`: the deferred copies, then the
write), and :meth:`Overlap.fence` before the next save, ``wait()`` and ``close()``; the guarded optimizers'
step pre-hooks call :meth:`Overlap.before_update` (whose wait goes to the last guarded save's
``stats.fence_s``) and their post-hooks ``turn.release`` (Lightning runs
forward and backward *inside* ``optimizer.step(closure)``, so its adapter fences from
``on_before_optimizer_step`` instead, and only the post-hook is installed).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from persist_core.errors import ConfigError
from persist_core.handle import SaveHandle
from persist_core.turn import Turn
from persist_core.planning.save import EntryCopy

log = logging.getLogger(__name__)


class Guard:
    """What :meth:`CheckpointEngine.guard` returns: ``remove()`` takes the optimizers' hooks off again."""

    def __init__(self, overlap: Overlap, optimizers: tuple[Any, ...], hooks: list[Any]) -> None:
        self._overlap, self._optimizers, self._hooks = overlap, optimizers, hooks

    def remove(self) -> None:
        """Undo the guard (idempotent): a pending background copy finishes first (no update waits for it once
        the hooks are gone), and the next ``save()`` returns once everything is copied, as without one."""
        self._overlap.fence()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._overlap._drop(self._optimizers)

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class Overlap:
    """The background copy of guarded saves: one thread, in save order; :meth:`fence` waits for it."""

    def __init__(self, rank: int = 0) -> None:
        self.turn = Turn()
        self._rank = rank  # for the log lines
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="persist-copy")
        self._lock = threading.Lock()
        self._optimizers: list[Any] = []
        self._pending: Future[None] | None = None
        self._last: SaveHandle | None = None  # the last save whose copy went to the background (None: a snapshot)
        self.fence_s = 0.0  # total time fences waited (the overlap's cost to training)
        self.runs = 0  # saves and memory snapshots whose copy ran in the background

    @property
    def active(self) -> bool:
        return bool(self._optimizers)

    def guard(self, optimizers: tuple[Any, ...], fence: Callable[[], object] | None) -> Guard:
        """``CheckpointEngine.guard``: ``fence`` before each optimizer's step (``None``: the caller fences), the
        turn given back after it. Raises ``ConfigError`` unless ``optimizers`` are torch optimizers."""
        if not optimizers or not all(hasattr(o, "register_step_pre_hook") for o in optimizers):
            raise ConfigError(f"guard({', '.join(type(o).__name__ for o in optimizers) or ''}) needs torch optimizers "
                              "(whose step() the copy must finish before)")

        def pre_hook(*_: Any) -> None:  # a step pre-hook must return None (or new arguments)
            assert fence is not None
            fence()

        def post_hook(*_: Any) -> None:
            self.turn.release()

        hooks = [] if fence is None else [opt.register_step_pre_hook(pre_hook) for opt in optimizers]
        hooks += [opt.register_step_post_hook(post_hook) for opt in optimizers]
        with self._lock:
            self._optimizers.extend(optimizers)
            self.turn.guarded = True
        return Guard(self, optimizers, hooks)

    def _drop(self, optimizers: tuple[Any, ...]) -> None:
        with self._lock:
            self._optimizers = [o for o in self._optimizers if not any(o is p for p in optimizers)]
            self.turn.guarded = bool(self._optimizers)
        self.turn.release()  # no post-hook of theirs will end a hold now

    def deferral(self) -> Callable[[EntryCopy], bool] | None:
        """Which copies of a save go to the background (``stage``'s ``defer``): those of the guarded optimizers'
        parameters and state tensors; ``None`` with no guard."""
        deferred = self.deferred()
        if not deferred:
            return None
        return lambda c: isinstance(c.source, torch.Tensor) and c.source.untyped_storage().data_ptr() in deferred

    def deferred(self) -> set[int]:
        """Storage addresses of the guarded optimizers' parameters and state tensors: copied in the background."""
        ptrs: set[int] = set()
        with self._lock:
            optimizers = list(self._optimizers)
        for opt in optimizers:
            for group in opt.param_groups:
                ptrs.update(p.untyped_storage().data_ptr() for p in group["params"])
            for state in opt.state.values():
                ptrs.update(v.untyped_storage().data_ptr() for v in state.values()
                            if isinstance(v, torch.Tensor) and v.numel() > 0)
        return ptrs

    def run(self, handle: SaveHandle | None, fn: Callable[[], None]) -> None:
        """Run ``fn`` (``handle``'s deferred copy, then the write's submission; no handle: a memory snapshot's
        deferred copy, then its record) on the copy thread."""
        self.runs += 1
        self._last = handle  # the next update's fence waits for this one's copy
        self._pending = self._thread.submit(fn)

    def before_update(self) -> float:
        """A guarded update is about to run: wait for the pending copy (the wait is added to the last guarded
        save's ``stats.fence_s``), then hold the writers off until the optimizer's step post-hook; the seconds
        waited."""
        waited = self.fence()
        last = self._last
        if waited > 0 and last is not None:  # the copy waited for is the last guarded save's
            last._update(fence_s=last.stats.fence_s + waited)
            log.debug("[rank=%d] the update waited %.3f s for the copy of step %d", self._rank, waited, last.step)
        if self.active:
            self.turn.hold()
        return waited

    def fence(self) -> float:
        """Wait for the pending background copy; the seconds waited. Called outside an update (a save,
        ``wait()``), it also gives the writers their turn back."""
        self.turn.release()
        pending = self._pending
        if pending is None or pending.done():
            return 0.0
        t0 = time.perf_counter()
        pending.result()  # fn records its own failure (the ledger); it never raises here
        waited = time.perf_counter() - t0
        self.fence_s += waited
        return waited

    def close(self) -> None:
        self.fence()
        self._thread.shutdown(wait=True)
