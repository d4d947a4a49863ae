"""The fakes tests share: failing and gated file calls, gated uploads, a fake clock, hand-made collectives.

Each is a real part with one thing changed (a real ``os`` call that fails the Nth time, a real
upload that waits for an event), so a test synchronises on events, never on sleeps.
"""

from __future__ import annotations

import errno
import os
import threading
from typing import Any

from persist_core.fileio import OsFileOps
from persist_core.tiers.remote import RemoteTier


class FailingOps(OsFileOps):
    """Real file calls, except that the Nth shard ``pwrite`` (1-based; every one with ``fail_at=1``
    and ``always=True``) fails with ``err``."""

    def __init__(self, fail_at: int = 1, err: int = errno.ENOSPC, *, always: bool = False) -> None:
        self.fail_at, self.err, self.always, self.calls = fail_at, err, always, 0
        self._lock = threading.Lock()

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        with self._lock:
            self.calls += 1
            fail = self.calls == self.fail_at or (self.always and self.calls >= self.fail_at)
        if fail:
            raise OSError(self.err, os.strerror(self.err))
        return super().pwrite(fd, data, offset)


class GatedOps(OsFileOps):
    """Real file calls; shard writes block until ``gate`` is set (``entered`` tells they began).

    Args:
        open_gate: start with the gate open (writes go through until a test clears it).
    """

    def __init__(self, open_gate: bool = False) -> None:
        self.gate, self.entered = threading.Event(), threading.Event()
        if open_gate:
            self.gate.set()

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        self.entered.set()
        assert self.gate.wait(60), "test gate never opened"
        return super().pwrite(fd, data, offset)


class GatedStepOps(OsFileOps):
    """Real file calls; opening a file of step ``step``'s temporary directory blocks until ``gate`` is set
    (``entered`` tells it began). The other steps' writes go through: only that step's commit waits."""

    def __init__(self, step: int) -> None:
        self.marker = f".tmp-step-{step:012d}-"
        self.gate, self.entered = threading.Event(), threading.Event()

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        if self.marker in path:
            self.entered.set()
            assert self.gate.wait(60), "test gate never opened"
        return super().open(path, flags, mode)


class NoDirectOps(OsFileOps):
    """A file system that refuses O_DIRECT at open, as tmpfs and some network file systems do."""

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return super().open(path, flags, mode)


class GatedUploads:
    """Makes ``RemoteTier.upload`` wait for ``gate`` (``started`` tells which steps began)."""

    def __init__(self, monkeypatch: Any) -> None:
        self.gate = threading.Event()
        self.started: list[int] = []
        self.first_started = threading.Event()
        original = RemoteTier.upload

        def upload(tier: RemoteTier, local_ckpt: Any, manifest: Any) -> None:
            self.started.append(manifest.step)
            self.first_started.set()
            assert self.gate.wait(60)
            return original(tier, local_ckpt, manifest)

        monkeypatch.setattr(RemoteTier, "upload", upload)


class FakeClock:
    """A clock that moves only when a test moves it (``clock.now += 5``)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class TwoRanksWithoutDecisions:
    """Collectives of a two-rank job built by hand, with no channel for the training thread."""

    rank, world_size = 0, 2

    def broadcast(self, obj: Any) -> Any:
        return obj

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj, obj]


def record_upload_turns(monkeypatch: Any) -> list[str]:
    """The names of the threads that ask for the guarded update's turn while sending an upload (inside a
    transfer's ``put_file`` or its progress callback: not the local writes, not the retention after it);
    the real turn is waited for as before."""
    import traceback

    from persist_core.turn import Turn

    callers: list[str] = []
    wait = Turn.wait

    def recording(self: Turn) -> None:
        if any(frame.name in ("put_file", "on_progress", "call") for frame in traceback.extract_stack()):
            callers.append(threading.current_thread().name)
        wait(self)

    monkeypatch.setattr(Turn, "wait", recording)
    return callers
