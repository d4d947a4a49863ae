"""Rank information and the few collectives a multi-rank commit needs.

The engine never detects a process group itself: the adapter (or the user) passes a
:class:`Collectives`, created once at the edge. Single-process use gets :class:`SingleProcess`,
a null object whose collectives return at once.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

from persist_core.errors import ConfigError

log = logging.getLogger(__name__)


@runtime_checkable
class Collectives(Protocol):
    """What the engine's writer thread calls to commit one checkpoint across ranks.

    Call order, per save, on every rank alike: ``broadcast`` (rank 0's temporary directory),
    ``all_gather`` (each rank's written file, or its error), ``broadcast`` (rank 0's commit
    outcome). Every rank makes every call, even after a failure of its own, so none waits forever.
    """

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj``, on every rank."""
        ...

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, indexed by rank."""
        ...


def decision_channel(coll: Collectives) -> Collectives | None:
    """The collectives the *training* thread may call to agree on a save decision.

    They must not be the commit's own (the writer thread runs those at the same time, and two
    threads on one group interleave their calls differently on each rank). A single process
    needs none; :class:`TorchCollectives` from :meth:`TorchCollectives.new_group` carries a
    second group for it. ``None`` when ``coll`` has no such channel.
    """
    if coll.world_size == 1:
        return coll
    return getattr(coll, "decisions", None)


@runtime_checkable
class PointToPoint(Protocol):
    """Byte messages between two ranks, over a process group of their own (the memory tier's partner copies,
    :mod:`persist_core.memory.partner`). A message is received into a buffer of its exact length; ``send`` returns
    once the peer has it. Messages between two ranks with one tag arrive in order; tags keep streams apart."""

    def send(self, data: bytes | bytearray | memoryview, peer: int, tag: int) -> None: ...

    def recv_into(self, buf: bytearray | memoryview, peer: int, tag: int) -> None: ...


def point_to_point(coll: Collectives, *, background: bool) -> PointToPoint | None:
    """A new :class:`PointToPoint` channel over all ranks of ``coll`` (a collective call: every rank makes it,
    in the same order), or ``None`` where ``coll`` cannot make one. ``background``: for a thread that waits on its
    peer as long as the run lasts (no timeout to speak of)."""
    make = getattr(coll, "new_point_to_point", None)
    return None if make is None else make(background=background)


class SingleProcess:
    """The collectives of a job with one process."""

    rank = 0
    world_size = 1

    def broadcast(self, obj: Any) -> Any:
        return obj

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]

    def __repr__(self) -> str:
        return "SingleProcess()"


class TorchCollectives:
    """Collectives over a ``torch.distributed`` group of its own (gloo: CPU objects, any thread).

    The engine calls them from its writer thread while training runs collectives of its own on
    the default group, so they must not share it. Create with :meth:`new_group` on every rank
    at once, after ``torch.distributed`` is initialized.
    """

    def __init__(self, group: Any, decisions: Any = None, uploads: Any = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        #: collectives over a second group, for the training thread's save decisions
        #: (``maybe_save``) and restore agreement; ``None`` when built from one group only
        self.decisions: TorchCollectives | None = None if decisions is None else TorchCollectives(decisions)
        #: collectives over a third group, for the sync threads assembling a remote copy from several
        #: nodes (:mod:`persist_core.sync.nodes`); ``None`` when not built by :meth:`new_group`
        self.uploads: TorchCollectives | None = None if uploads is None else TorchCollectives(uploads)
        self._group = group
        self._rank = dist.get_rank(group)
        self._world = dist.get_world_size(group)
        self._src = dist.get_global_rank(group, 0)
        self._timeout = timedelta(seconds=1800)  # a restore's messages (new_point_to_point)

    @classmethod
    def new_group(cls, timeout_s: float = 1800.0) -> TorchCollectives:
        """Three gloo groups over all ranks (a collective call: every rank must make it).

        One carries the commit (the engine's writer thread), one the training thread's save
        decisions and restore agreement (:attr:`decisions`), one the sync threads' upload rounds
        on several nodes (:attr:`uploads`, which wait for rank 0 as long as a run lasts), so none
        interleave.

        Args:
            timeout_s: how long a rank waits for the others in one commit before the save fails
                (the slowest rank's write is inside that wait).
        """
        import torch.distributed as dist

        timeout = timedelta(seconds=timeout_s)
        made = cls(dist.new_group(backend="gloo", timeout=timeout), dist.new_group(backend="gloo", timeout=timeout),
                   dist.new_group(backend="gloo", timeout=timedelta(days=7)))
        made._timeout = timeout
        return made

    def new_point_to_point(self, *, background: bool) -> TorchPointToPoint:
        """A gloo group of its own for byte messages (:func:`point_to_point`; every rank calls it at once)."""
        timeout = timedelta(days=7) if background else self._timeout
        return TorchPointToPoint(self._dist.new_group(backend="gloo", timeout=timeout))

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        self._dist.broadcast_object_list(box, src=self._src, group=self._group)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self._world
        self._dist.all_gather_object(out, obj, group=self._group)
        return out

    def barrier(self, timeout_s: float = 60.0) -> bool:
        """Wait until every rank is here (gloo's monitored barrier: a missing rank ends the wait after
        ``timeout_s``, logged, instead of hanging). Adapters call it when they close, so no rank tears the
        process groups down while another still uses them (gloo aborts a process then, at times)."""
        try:
            self._dist.monitored_barrier(group=self._group, timeout=timedelta(seconds=timeout_s))
        except Exception as e:  # a rank that left early, or a group already torn down: closing goes on
            log.warning("ranks did not all reach the closing barrier (%s: %s)", type(e).__name__, e)
            return False
        return True

    def __repr__(self) -> str:
        return f"TorchCollectives(rank={self._rank}, world_size={self._world})"


class TorchPointToPoint:
    """:class:`PointToPoint` over a gloo group (``peer``: the global rank)."""

    def __init__(self, group: Any) -> None:
        import torch
        import torch.distributed as dist

        self._torch, self._dist, self._group = torch, dist, group

    def send(self, data: bytes | bytearray | memoryview, peer: int, tag: int) -> None:
        buf = data if isinstance(data, (bytearray, memoryview)) and not memoryview(data).readonly else bytearray(data)
        self._dist.send(self._torch.frombuffer(buf, dtype=self._torch.uint8), dst=peer, group=self._group, tag=tag)

    def recv_into(self, buf: bytearray | memoryview, peer: int, tag: int) -> None:
        self._dist.recv(self._torch.frombuffer(buf, dtype=self._torch.uint8), src=peer, group=self._group, tag=tag)


def check_collectives(value: Any) -> Collectives:
    """``value`` if it has the :class:`Collectives` calls (``None``: one process); else a ConfigError."""
    if value is None:
        return SingleProcess()
    missing = [n for n in ("rank", "world_size", "broadcast", "all_gather") if not hasattr(value, n)]
    if missing:
        raise ConfigError(f"collectives={value!r} lacks {', '.join(missing)}; pass TorchCollectives.new_group() "
                          "(after torch.distributed is initialized), or None for one process")
    return value
