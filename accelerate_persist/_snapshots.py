"""The memory tier under Accelerate: ``PersistHook(memory_every_n_steps=N)`` on its own keeps a snapshot every N
optimizer steps, with no call in the training loop.

When is a step's state whole? Not at the optimizer's step: the user's ``scheduler.step()``, counters and
``zero_grad`` come after it, and the hook counts the step only once the wrapped ``step()`` returns (under gradient
accumulation, only where gradients synced and the ``GradScaler`` did not skip it). So the snapshot of step N is
taken where the next step begins, after the count reached N: on entering ``accelerator.accumulate(...)`` (before it
counts the micro-batch that decides when gradients sync), or else at the first forward — a forward pre-hook on the
first prepared model — before that forward draws from the RNG or changes a BatchNorm's statistics. A step is offered to the tier once
(:meth:`~persist_core.session.PersistSession.first_offer`), also when ``hook.maybe_save()`` offered it already.

The last step of a run has no forward after it: a kill between it and ``close()`` loses that one step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["StepSnapshots"]


class StepSnapshots:
    """Offers each optimizer step to the memory tier at the first forward after it.

    Args:
        step: the hook's count of optimizer steps taken.
        offer: offers a step to the memory tier (every process calls it at the same forward: it gathers).
    """

    def __init__(self, step: Callable[[], int], offer: Callable[[int], Any]) -> None:
        self._step = step
        self._offer = offer
        self._last = step()  # the step the state was at when offered last (or at registration)
        self._handles: list[Any] = []
        self._accelerator: Any = None

    def install(self, accelerator: Any) -> None:
        """Hook ``accelerator.accumulate`` (on this instance) and the first prepared model's forward."""
        if accelerator._models:
            self._handles.append(accelerator._models[0].register_forward_pre_hook(self._before_forward))
        accumulate = accelerator.accumulate

        def offered_first(*models: Any) -> Any:
            self._before_forward(None, None)
            return accumulate(*models)  # a context manager: it counts the micro-batch on entering

        accelerator.accumulate = offered_first
        self._accelerator = accelerator

    def restored(self) -> None:
        """A checkpoint was loaded: its step is the state's, nothing new to keep."""
        self._last = self._step()

    def _before_forward(self, module: Any, args: Any) -> None:
        step = self._step()
        if step != self._last:
            self._last = step
            self._offer(step)

    def remove(self) -> None:
        """Give the model and the Accelerator back what :meth:`install` changed."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._accelerator is not None:
            vars(self._accelerator).pop("accumulate", None)  # the class's own again
            self._accelerator = None
