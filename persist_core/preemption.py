"""Preemption: on SIGTERM, let pending checkpoints commit and upload within a grace period.

The handler does no I/O itself: it waits (bounded by the grace period) for the engine's
background threads to finish what is pending, then hands the signal on to the handler that was
there before — by default, the process then ends as SIGTERM would have ended it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from persist_core.errors import ConfigError, PersistError

log = logging.getLogger(__name__)


def drain_within(wait: Callable[[float], None], grace_s: float) -> bool:
    """Call ``wait(grace_s)`` (an engine's ``wait``); ``False`` if time ran out, logging what is left."""
    try:
        wait(grace_s)
    except TimeoutError as e:
        log.error("preempted: %s; the local copies are committed and the next run uploads them", e)
        return False
    return True


def check_grace(grace_s: float) -> float:
    if not (isinstance(grace_s, (int, float)) and grace_s > 0):
        raise ConfigError(f"preemption_grace_s={grace_s!r} must be a positive number of seconds")
    return float(grace_s)


def install_sigterm_flush(wait: Callable[[], Callable[[float], None] | None],
                          grace_s: float) -> Callable[[], None] | None:
    """On SIGTERM, drain what ``wait()`` returns (an engine's ``wait``, or ``None``), then chain.

    Installs nothing off the main thread (Python only delivers signals there).

    Returns:
        A function that puts the previous handler back (if this one is still installed), or
        ``None`` when nothing was installed.
    """
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum: int, frame: Any) -> None:
        pending = wait()
        log.warning("SIGTERM: waiting up to %.0f s for pending checkpoints and uploads", grace_s)
        if pending is not None:
            try:
                drain_within(pending, grace_s)
            except PersistError as e:
                log.error("SIGTERM: a pending checkpoint failed: %s", e)
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)

    def restore() -> None:
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is on_sigterm:
            signal.signal(signal.SIGTERM, previous)

    return restore
