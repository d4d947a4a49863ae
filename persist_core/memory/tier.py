"""What the engine's memory calls do (``snapshot``, ``maybe_snapshot``, ``wait_snapshot``, and the memory tier's
part of ``maybe_save``, ``wait`` and ``close``): :class:`MemorySide` over one engine's :class:`~persist_core.memory.snapshots.Snapshots`
and :class:`~persist_core.memory.partner.PartnerCopies`; :data:`NO_MEMORY` without a memory tier (the same calls, no
``None`` checks in the engine). The copy itself is the save flow's (its ``Saver``), known here by
:class:`Stager`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from persist_core.errors import ConfigError
from persist_core.memory.partner import PartnerCopies
from persist_core.memory.snapshots import Snapshots


class Stager(Protocol):
    """The save flow's part of a snapshot (:class:`~persist_core.save.saver.Saver`)."""

    def snapshot(self, state: Any, step: int, *, metadata: dict[str, Any] | None, resumed_at: int | None) -> None:
        """Stage ``state`` as ``step`` into a slot of the memory tier (checks, plans, copies; no disk)."""
        ...

    def allow(self, step: int, resumed_at: int | None) -> None:
        """The run's timeline check a snapshot of ``step`` makes, without the snapshot."""
        ...


class MemorySide:
    """One engine's memory tier, as the engine's calls reach it (training thread).

    Args:
        snapshots: the save side.
        partner: the partner copies (several nodes), or ``None``.
        stager: the save flow's copy into a slot.
        world_size: how many ranks (with several, a snapshot out of room still makes the timeline's collective check).
    """

    def __init__(self, snapshots: Snapshots, partner: PartnerCopies | None, stager: Stager, *,
                 world_size: int) -> None:
        self.snapshots, self._partner, self._stager, self._world_size = snapshots, partner, stager, world_size

    def snapshot(self, state: Any, step: int, *, metadata: dict[str, Any] | None, resumed_at: int | None) -> None:
        """``CheckpointEngine.snapshot``: no partner copy (those are of the steps :meth:`maybe_snapshot` takes)."""
        self._take(lambda: state, step, metadata, resumed_at, copies=False)

    def maybe_snapshot(self, make_state: Callable[[], Any], step: int, *, metadata: dict[str, Any] | None,
                       resumed_at: int | None) -> bool:
        """``CheckpointEngine.maybe_snapshot``: a snapshot if the tier is due at ``step``; whether one was taken."""
        if not self.snapshots.tier.due(step):
            return False
        return self._take(make_state, step, metadata, resumed_at)

    def beside_save(self, make_state: Callable[[], Any], step: int, *, saved: bool, metadata: dict[str, Any] | None,
                    resumed_at: int | None) -> bool:
        """``CheckpointEngine.maybe_save``'s part: a step one process ``saved`` to disk is a snapshot already (its
        staged shard); otherwise :meth:`maybe_snapshot`. Whether a snapshot was taken here."""
        if saved and self._world_size == 1:
            return False
        return self.maybe_snapshot(make_state, step, metadata=metadata, resumed_at=resumed_at)

    def _take(self, make_state: Callable[[], Any], step: int, metadata: dict[str, Any] | None,
              resumed_at: int | None, *, copies: bool = True) -> bool:
        """Snapshot ``step``; with partner copies (several nodes, ``copies``) every rank first agrees whether it is a
        copy step (a collective call: every rank snapshots the same steps). Whether a snapshot was taken."""
        if not self.snapshots.before(step, copies=copies):  # out of room: disk only
            if self._world_size > 1:  # the run's timeline checked as a snapshot would (with several ranks, a
                self._stager.allow(step, resumed_at)  # collective call the first time)
            return False
        self._stager.snapshot(make_state(), step, metadata=metadata, resumed_at=resumed_at)
        return True

    def wait_snapshot(self) -> None:
        """Until the newest snapshot is committed."""
        self.snapshots.wait()

    def wait(self, timeout: float | None) -> None:
        """``CheckpointEngine.wait``'s part: every snapshot taken committed, then the newest one's partner copy sent
        (at most ``timeout`` s)."""
        self.snapshots.wait()
        if self._partner is not None:
            self._partner.flush(timeout)

    def close(self, *, finished: bool, disk_step: Callable[[], int]) -> None:
        """The partner copies first (before the slots they read go), then the snapshots; ``finished``: the run ended
        well (its snapshots go), ``disk_step``: the newest disk checkpoint (see :meth:`Snapshots.close`)."""
        if self._partner is not None:
            self._partner.close(finished=finished)
        self.snapshots.close(finished=finished, disk_step=disk_step)


class NoMemory:
    """No memory tier: a snapshot asked for is a ConfigError; the rest does nothing."""

    def snapshot(self, state: Any, step: int, *, metadata: dict[str, Any] | None, resumed_at: int | None) -> None:
        raise ConfigError("snapshot() needs CheckpointEngine(memory=MemoryTier(...))")

    def maybe_snapshot(self, make_state: Callable[[], Any], step: int, *, metadata: dict[str, Any] | None,
                       resumed_at: int | None) -> bool:
        return False

    def beside_save(self, make_state: Callable[[], Any], step: int, *, saved: bool, metadata: dict[str, Any] | None,
                    resumed_at: int | None) -> bool:
        return False

    def wait_snapshot(self) -> None:
        pass

    def wait(self, timeout: float | None) -> None:
        pass

    def close(self, *, finished: bool, disk_step: Callable[[], int]) -> None:
        pass


NO_MEMORY = NoMemory()
