"""Preemption: a notice a signal sets, and the flush that acts on it off the signal handler.

A signal handler here only records the signal (an ``Event.set``, or one byte written to a pipe):
it never takes a lock the interrupted code may hold and never waits. Two ways to act on it:

* :class:`PreemptionNotice`: the job's save policy sees it at the next decision point
  (:meth:`CheckpointEngine.maybe_save` saves that step on every rank, waits up to the grace
  period for the commit and upload, and tells the loop to stop);
* :class:`SignalFlush` (no save policy): the handler wakes a flusher thread, which waits up to
  the grace period for what is pending (an engine's ``wait``), then raises the signal again; the
  handler, seeing the flush done, hands it to the handler that was there before — on the main
  thread, where Python runs handlers — by default ending the process as the signal would have.

Install both from the main thread (Python delivers signals there).
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

#: an engine's ``wait(timeout)``, or ``None`` when there is nothing to drain
Drain = Callable[[], "Callable[[float], None] | None"]


def drain_within(wait: Callable[[float], None], grace_s: float) -> bool:
    """Call ``wait(grace_s)`` (an engine's ``wait``); ``False`` if time ran out, logging what is left."""
    try:
        wait(grace_s)
    except TimeoutError as e:
        log.error("preempted: %s; the local copies are committed and the next run uploads them", e)
        return False
    return True


def check_grace(grace_s: float) -> float:
    if isinstance(grace_s, bool) or not (isinstance(grace_s, (int, float)) and grace_s > 0):
        raise ConfigError(f"preemption_grace_s={grace_s!r} must be a positive number of seconds")
    return float(grace_s)


class PreemptionNotice:
    """A flag set by a signal (SIGTERM by default); the handler does nothing else but chain.

    The previous handler runs too when it is a Python function (Lightning's, for instance); the
    default action (ending the process) is replaced: the job saves at its next decision point
    and leaves on its own. Install from the main thread.

    Args:
        signals: the signals that mean "preempted" (e.g. ``(signal.SIGTERM, signal.SIGUSR1)``).

    Raises:
        ConfigError: not on the main thread, or a signal that cannot be caught.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,), *, exit_after: bool = False) -> None:
        self.exit_after = exit_after  # the engine's default notice: once handled, the signal's own disposition runs
        self._signals = tuple(signals)
        self._event = threading.Event()
        self._previous: dict[int, Any] = {}
        self.signum: int | None = None
        if threading.current_thread() is not threading.main_thread():
            raise ConfigError("a PreemptionNotice must be created on the main thread (signals are delivered there)")
        for sig in signals:
            try:
                previous = signal.getsignal(sig)
                signal.signal(sig, self._handle)
            except (TypeError, ValueError, OSError) as e:
                self.restore()
                raise ConfigError(f"signals={signals!r}: {sig!r} cannot be caught ({e}); pass catchable signals such "
                                  "as signal.SIGTERM or signal.SIGUSR1") from None
            self._previous[sig] = previous

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum
        self._event.set()
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)

    def is_set(self) -> bool:
        return self._event.is_set()

    def trigger(self) -> None:
        """Set the flag without a signal (a cloud's preemption notice polled by the job, tests)."""
        self._event.set()

    def exit_as_signal(self) -> None:
        """The checkpoint is handled: let the signal do what it did before this notice (by default end the
        process as it ends it, so schedulers see the right status). A previous Python handler already ran
        when the signal came; an ignored signal stays ignored."""
        sig = self.signum if self.signum is not None else self._signals[0]
        previous = self._previous.get(sig, signal.SIG_DFL)
        self.restore()
        if previous == signal.SIG_DFL:
            log.warning("preempted: the checkpoint is handled; ending the process as %s does", signal.Signals(sig).name)
            logging.shutdown()
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)

    def restore(self) -> None:
        """Put the previous handlers back (those still ours)."""
        for sig, handler in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, handler)


class SignalFlush:
    """On a signal, drain pending checkpoints within ``grace_s`` on a thread of its own, then chain.

    Who calls what: the main thread calls :meth:`install` and :meth:`restore`; the handler (main
    thread, any moment) writes the signal number to a pipe and returns; the flusher thread reads
    it, calls ``drain()``'s ``wait(grace_s)``, then sends the signal again, and the handler hands
    it to the previous handler. A second signal while the flush runs changes nothing.

    Args:
        drain: returns what to wait on (an engine's ``wait``), or ``None``.
        grace_s: the longest the flush waits.
        signals: the signals to catch (default SIGTERM).
    """

    def __init__(self, drain: Drain, grace_s: float, signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
        self._drain = drain
        self._grace_s = check_grace(grace_s)
        self._signals = tuple(signals)
        self._previous: dict[int, Any] = {}
        self._flushed = False  # set by the flusher before it raises the signal again
        self._woken = False
        self._read_fd = self._write_fd = -1
        self._thread: threading.Thread | None = None
        self.done = threading.Event()  # the flush ran and the signal was handed on (tests wait on it)

    def install(self) -> bool:
        """Install the handlers and start the flusher; ``False`` (nothing installed) off the main thread."""
        if threading.current_thread() is not threading.main_thread() or self._thread is not None:
            return False
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        for sig in self._signals:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)
        self._thread = threading.Thread(target=self._run, name="persist-flush", daemon=True)
        self._thread.start()
        return True

    def restore(self) -> None:
        """Put the previous handlers back (those still ours) and stop the flusher. Idempotent."""
        if self._thread is None:
            return
        if threading.current_thread() is threading.main_thread():
            for sig, previous in self._previous.items():
                if signal.getsignal(sig) == self._handle:
                    signal.signal(sig, previous)
        if not self._woken:
            self._woken = True  # the handler sends nothing from now on
            self._send(b"\0")  # 0: stop
        self._thread = None

    # ---- the handler: main thread, any moment; no lock, no wait

    def _handle(self, signum: int, frame: Any) -> None:
        if self._flushed:
            self._chain(signum, frame)
        elif not self._woken:
            self._woken = True
            self._send(bytes([signum]))

    def _send(self, byte: bytes) -> None:
        try:
            os.write(self._write_fd, byte)
        except OSError:  # closed already: the flusher is gone
            pass

    def _chain(self, signum: int, frame: Any) -> None:
        previous = self._previous.get(signum, signal.SIG_DFL)
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signum) == self._handle:
            signal.signal(signum, previous)
        self.done.set()
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    # ---- the flusher thread

    def _run(self) -> None:
        try:
            signum = os.read(self._read_fd, 1)[0]
        finally:
            os.close(self._read_fd)
        if signum == 0:
            os.close(self._write_fd)
            return
        log.warning("signal %d: waiting up to %.0f s for pending checkpoints and uploads", signum, self._grace_s)
        try:
            wait = self._drain()
            if wait is not None:
                drain_within(wait, self._grace_s)
        except PersistError as e:
            log.error("signal %d: a pending checkpoint failed: %s", signum, e)
        except BaseException:  # never leave the signal unhandled because the flush broke
            log.exception("signal %d: the flush failed", signum)
        finally:
            self._flushed = True
            os.close(self._write_fd)
            os.kill(os.getpid(), signum)  # the handler hands it on, on the main thread


def install_sigterm_flush(wait: Drain, grace_s: float) -> Callable[[], None] | None:
    """On SIGTERM, drain what ``wait()`` returns within ``grace_s``, then chain (see :class:`SignalFlush`).

    Returns:
        A function that puts the previous handler back, or ``None`` when nothing was installed
        (off the main thread).
    """
    flush = SignalFlush(wait, grace_s)
    return flush.restore if flush.install() else None


def default_notice(save_policy: Any) -> PreemptionNotice | None:
    """With a save policy, the engine's own SIGTERM notice (it ends the process once the checkpoint is
    handled); none without one, or off the main thread (where signals cannot be caught)."""
    if save_policy is None:
        return None
    if threading.current_thread() is not threading.main_thread():
        log.info("no SIGTERM notice installed: the engine was created off the main thread; pass "
                 "preemption=PreemptionNotice() from the main thread to save at a preemption")
        return None
    return PreemptionNotice(exit_after=True)
