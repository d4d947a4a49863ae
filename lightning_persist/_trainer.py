"""The Trainer around a ``CheckpointIO``: finding it on the call stack, its loggers, its console, its exit.

A ``CheckpointIO`` holds no reference to its Trainer; Lightning calls it from ``Trainer.save_checkpoint``
(and the strategy's hooks) a few frames up, so :func:`find_trainer` looks there.
"""

from __future__ import annotations

import signal
import sys
from typing import Any, Callable

Sink = Callable[[dict[str, float], int], None]


def find_trainer() -> Any | None:
    """The Trainer whose ``save_checkpoint`` is on the call stack, to log through its loggers.

    ``None`` under Fabric or when called directly.
    """
    trainer_cls = sys.modules.get("lightning.pytorch.trainer.trainer")
    classes = [getattr(m, "Trainer", None) for m in (trainer_cls, sys.modules.get("pytorch_lightning.trainer.trainer"))]
    classes = tuple(c for c in classes if c is not None)
    if not classes:
        return None
    frame = sys._getframe(1)
    for _ in range(12):
        if frame is None:
            return None
        for name in ("self", "trainer"):  # the Trainer's own methods; callbacks' hooks (ModelCheckpoint)
            candidate = frame.f_locals.get(name)
            if isinstance(candidate, classes):
                return candidate
        frame = frame.f_back
    return None


def loggers_sink(trainer: Any | None) -> Sink | None:
    """Where a save's metrics go: each of the Trainer's loggers (``None`` without a Trainer)."""
    if trainer is None:
        return None

    def to_loggers(metrics: dict[str, float], step: int) -> None:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    return to_loggers


def rank_zero_info(text: str) -> None:
    """The console channel of a default Lightning run (its rank-zero INFO logger)."""
    from lightning.pytorch.utilities import rank_zero_info as info

    info(text)


SIGTERM_STATUS = 128 + signal.SIGTERM


def exit_as_sigterm() -> None:
    """End with the status SIGTERM gives (143) once everything is flushed.

    Lightning 2.x stops on SIGTERM by raising ``SIGTERMException`` (a ``SystemExit`` without a code,
    so status 0) and tears the strategy down while handling it: that exception gets the status.
    When it stopped without one (an older Lightning), raise it here.
    """
    in_flight = sys.exc_info()[1]
    if isinstance(in_flight, SystemExit):
        if in_flight.code in (None, 0):
            in_flight.code = SIGTERM_STATUS
        return
    if in_flight is None:
        raise SystemExit(SIGTERM_STATUS)
