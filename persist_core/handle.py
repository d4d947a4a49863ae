"""``SaveHandle``: one future per phase of one save, its stats; ``ErrorLedger``: errors raised once.

The engine creates a handle in ``save()`` (the *staged* phase is done by then); the writer thread
completes the *local* phase, the sync thread the *remote* one. Users call
:meth:`SaveHandle.wait` or poll :meth:`SaveHandle.done`. A failure is raised by exactly one call:
the first ``wait()`` on the handle, or else the engine's next ``wait()``/``save()``/``close()``
(through the :class:`ErrorLedger` every background thread records failures in).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from persist_core._knobs import check_timeout


@dataclass(frozen=True)
class SaveStats:
    """Durations (seconds) and sizes of one save; later phases are ``None`` until they finish.

    Attributes:
        step: the step saved.
        nbytes: bytes of the shard files (what the disk receives).
        wait_s: time ``save()`` waited for the previous checkpoint's write to free its buffer.
        staging_s: time copying the state into the staging buffer (device-to-host included).
        stall_s: everything ``save()`` blocked the caller for (``wait_s + staging_s`` + planning).
        fence_s: how long the next guarded update waited at the fence for this save's background copy
            (0 when the copy ended within the step, and for saves without a guard); apart from ``stall_s``.
        write_s: time writing and fsyncing the shard files.
        write_gbps: ``nbytes / write_s`` in GB/s (10**9 bytes).
        commit_s: from ``save()`` returning to the checkpoint being committed and durable.
        direct_io: whether the shard was written with ``O_DIRECT``.
        upload_s: time uploading to the remote tier (shards and manifest).
        upload_gbps: ``nbytes / upload_s`` in GB/s.
        lag_s: from the local commit to the remote commit (queueing included).
        lag_steps: how many steps newer the newest saved checkpoint was at the remote commit.
        superseded: the upload was skipped for a newer checkpoint (the remote was behind).
        unchanged_bytes: ``incremental=True``: bytes of host tensors found unchanged before the copy (hashed where
            they lie, equal to the newest committed checkpoint's): neither copied nor written, referenced.
    """

    step: int
    nbytes: int = 0
    wait_s: float = 0.0
    staging_s: float = 0.0
    stall_s: float = 0.0
    fence_s: float = 0.0
    write_s: float | None = None
    write_gbps: float | None = None
    commit_s: float | None = None
    direct_io: bool | None = None
    upload_s: float | None = None
    upload_gbps: float | None = None
    lag_s: float | None = None
    lag_steps: int | None = None
    superseded: bool = False
    unchanged_bytes: int = 0

    def metrics(self, prefix: str = "persist/") -> dict[str, float]:
        """The numbers adapters report to loggers: stall, the fence's wait, bytes, save -> durable, write/upload
        speed and lag once known, and whether its upload was superseded."""
        out = {f"{prefix}stall_s": self.stall_s, f"{prefix}fence_s": self.fence_s, f"{prefix}bytes": float(self.nbytes),
               f"{prefix}superseded": float(self.superseded)}
        if self.commit_s is not None:
            out[f"{prefix}durable_s"] = self.stall_s + self.commit_s  # save() called -> committed and durable
        for name in ("write_gbps", "upload_gbps", "lag_s"):
            value = getattr(self, name)
            if value is not None:
                out[f"{prefix}{name}"] = value
        return out


class SaveHandle:
    """The progress of one ``CheckpointEngine.save``.

    Example::

        handle = engine.save(state, step=100)   # returns once staged: mutate freely
        handle.wait()                           # committed on local disk, or raises once
        stall, speed = handle.stats.stall_s, handle.stats.write_gbps
    """

    def __init__(self, stats: SaveStats) -> None:
        self._stats = stats
        self._staged: Future[None] = Future()  # done at once, or (a guarded save) when the background copy is
        self._local: Future[None] = Future()
        self._remote: Future[None] = Future()
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._failed = False
        self._callbacks: list[Callable[[bool], None]] = []
        self._local_ended = False

    @property
    def step(self) -> int:
        return self._stats.step

    @property
    def stats(self) -> SaveStats:
        """A snapshot of this save's stats so far."""
        return self._stats

    def done(self) -> bool:
        """Whether every phase has finished (successfully or not)."""
        return self._local.done() and self._remote.done()

    def add_local_callback(self, fn: Callable[[bool], None]) -> None:
        """Call ``fn(committed)`` once the local phase ends: ``True`` when the checkpoint is committed.

        ``fn`` runs on the engine's writer thread before ``wait_local()`` returns anywhere (or at
        once, if the phase already ended); it must be quick and must not raise. The failure
        itself is still raised once by a ``wait``.
        """
        with self._lock:
            if not self._local_ended:
                self._callbacks.append(fn)
                return
        fn(not self._failed)

    @property
    def staged(self) -> Future[None]:
        """Done once the state is copied: when ``save()`` returns without a guard, when the background copy
        ends with one (:meth:`CheckpointEngine.guard`) — copied or failed: failures are raised by :meth:`wait`,
        never by this future, so a callback on it (``staged.add_done_callback``) runs either way."""
        return self._staged

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the state is copied (a guarded save copies in the background): after this the
        caller may mutate anything. Failures are raised by :meth:`wait`."""
        self._staged.result(check_timeout(timeout))

    def _set_staged(self) -> None:
        if not self._staged.done():
            self._staged.set_result(None)

    def wait_local(self, timeout: float | None = None) -> None:
        """Block until committed on the local tier.

        Raises:
            TimeoutError: not committed within ``timeout`` seconds (the save goes on).
            PersistError: the save failed, if no earlier call raised that failure.
        """
        self._wait_for(self._local, timeout)
        self._raise_error()

    def wait_remote(self, timeout: float | None = None) -> None:
        """Block until committed on the remote tier (or superseded by a newer checkpoint).

        Returns at once when the engine has no remote tier. Same errors as :meth:`wait_local`.
        """
        self._wait_for(self._remote, timeout)
        self._raise_error()

    def wait(self, timeout: float | None = None) -> None:
        """Block until every phase has finished; same errors as :meth:`wait_local`."""
        deadline = None if check_timeout(timeout) is None else time.monotonic() + timeout
        self._wait_for(self._local, timeout)
        self._wait_for(self._remote, None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._raise_error()

    def _raise_error(self) -> None:
        error = self.take_error()
        if error is not None:
            raise error

    # ---- engine side

    def _wait_for(self, phase: Future[None], timeout: float | None) -> None:
        try:
            phase.result(check_timeout(timeout))
        except FutureTimeout:
            raise TimeoutError(f"checkpoint step {self.step} not committed within {timeout} s") from None

    def take_error(self) -> BaseException | None:
        """The failure, if any, unless some call already took it (engine side)."""
        with self._lock:
            error, self._error = self._error, None
            return error

    def _update(self, **changes: object) -> None:
        with self._lock:
            self._stats = dataclasses.replace(self._stats, **changes)

    def _end_local(self) -> None:
        """Run the local callbacks, then wake the waiters."""
        with self._lock:
            callbacks, self._callbacks = self._callbacks, []
            committed = not self._failed
            self._local_ended = True
        for fn in callbacks:
            fn(committed)
        self._local.set_result(None)

    def _set_local_done(self) -> None:
        with self._lock:
            ended = self._local_ended
        if not ended:
            self._end_local()

    def _set_remote_done(self) -> None:
        if not self._remote.done():  # a failure may have ended it already
            self._remote.set_result(None)

    def _set_failed(self, error: BaseException) -> None:
        """Record ``error``; every phase not yet finished ends with it."""
        with self._lock:
            self._error = error
            self._failed = True
        with self._lock:
            ended = self._local_ended
        if not ended:
            self._end_local()
        if not self._remote.done():
            self._remote.set_result(None)


class ErrorLedger:
    """Background failures not raised yet; each is raised exactly once, then forgotten.

    Who calls what: the writer and sync threads call :meth:`fail` (a save's failure, also raised by
    that handle's own ``wait``) or :meth:`add` (a failure of no one save, e.g. the first listing of
    the remote); the engine's ``save``/``wait``/``close`` call :meth:`raise_first` on the training
    thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: list[SaveHandle | BaseException] = []

    def fail(self, handle: SaveHandle, error: BaseException, *, remote: bool = False) -> None:
        """End ``handle``'s unfinished phases with ``error``, to be raised once by whoever asks first.

        An upload failure (``remote=True``) is raised only by that handle's own ``wait``: the
        engine's ``save``/``wait`` never raise it (``wait`` raises one error naming every step
        still un-synced instead), so an outage neither stops training nor skips checkpoints.
        """
        handle._set_failed(error)  # first: the entry below must find the error there
        if remote:
            return
        with self._lock:
            self._entries.append(handle)

    def add(self, error: BaseException) -> None:
        with self._lock:
            self._entries.append(error)

    def raise_first(self) -> None:
        """Raise the oldest failure nobody has raised yet (skipping ones a handle's ``wait`` raised)."""
        while True:
            with self._lock:
                if not self._entries:
                    return
                entry = self._entries.pop(0)
            error = entry.take_error() if isinstance(entry, SaveHandle) else entry
            if error is not None:
                raise error
