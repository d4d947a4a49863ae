"""The memory tier under Accelerate: ``PersistHook(memory_every_n_steps=N)`` on its own keeps a snapshot every N
optimizer steps, with no call in the training loop.

When is a step's state whole? Not at the optimizer's step: the user's ``scheduler.step()``, counters and
``zero_grad`` come after it, and the hook counts the step only once the wrapped ``step()`` returns (under gradient
accumulation, only where gradients synced and the ``GradScaler`` did not skip it). So the snapshot of step N is
taken where the next step begins, after the count reached N: on entering ``accelerator.accumulate(...)`` (before it
counts the micro-batch that decides when gradients sync), or else at the first forward — a forward pre-hook on the
first prepared model — before that forward draws from the RNG or changes a BatchNorm's statistics. Its record is written in the background; the next
update (a step pre-hook on each inner optimizer) waits for it, so a kill anywhere loses at most one step. A step is
offered to the tier once
(:meth:`~persist_core.session.PersistSession.first_offer`), also when ``hook.maybe_save()`` offered it already.

"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from accelerate_persist import _state
from persist_core import MemoryTier
from persist_core.session import PersistSession

__all__ = ["StepSnapshots"]


class StepSnapshots:
    """Offers each optimizer step to the memory tier where the next step begins (installed at construction, until
    :meth:`remove`).

    Args:
        session: the hook's session (its engine, the steps saved and offered).
        accelerator: the Accelerator whose state a snapshot captures.
        memory: the memory tier (its ``every_n_steps``).
        step: the hook's count of optimizer steps taken.
    """

    def __init__(self, session: PersistSession, accelerator: Any, memory: MemoryTier, step: Callable[[], int]) -> None:
        self._session = session
        self._accelerator = accelerator
        self._memory = memory
        self._step = step
        self._last = step()  # the step the state was at when offered last (or at registration)
        self._handles: list[Any] = []
        if accelerator._models:
            self._handles.append(accelerator._models[0].register_forward_pre_hook(self._before_forward))
        accumulate = accelerator.accumulate

        def offered_first(*models: Any) -> Any:
            self._before_forward(None, None)
            return accumulate(*models)  # a context manager: it counts the micro-batch on entering

        accelerator.accumulate = offered_first
        for optimizer in accelerator._optimizers:  # the inner one runs only for steps that happen (no skipped step)
            inner = getattr(optimizer, "optimizer", optimizer)
            self._handles.append(inner.register_step_pre_hook(self._before_update))

    def offer(self, step: int) -> bool:
        """Snapshot ``step`` when the tier is due there, once a step (every process alike: the capture gathers, also
        where the tier gave up for want of room); whether it was taken. One process: a step just saved to disk is a
        snapshot already."""
        session = self._session
        if not self._memory.due(step) or not session.first_offer(step):
            return False
        state = _state.capture(self._accelerator, optimizer_steps=step)
        return session.open().maybe_snapshot(lambda: state, step)

    def restored(self) -> None:
        """A checkpoint was loaded: its step is the state's, nothing new to keep."""
        self._last = self._step()

    def _before_forward(self, module: Any, args: Any) -> None:
        step = self._step()
        if step != self._last:
            self._last = step
            self.offer(step)

    def _before_update(self, *args: Any) -> None:
        """The last snapshot is committed before an update (its record is written in the background): a kill after
        the update loses that one step only."""
        engine = self._session.engine
        if engine is not None:
            engine.wait_snapshot()

    def remove(self) -> None:
        """Give the model and the Accelerator back what the constructor changed."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        vars(self._accelerator).pop("accumulate", None)  # the class's own again
