"""Rank information and the few collectives a multi-rank commit needs.

The engine never detects a process group itself: the adapter (or the user) passes a
:class:`Collectives`, created once at the edge. Single-process use gets :class:`SingleProcess`,
a null object whose collectives return at once.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Protocol, runtime_checkable


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

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._group = group
        self._rank = dist.get_rank(group)
        self._world = dist.get_world_size(group)
        self._src = dist.get_global_rank(group, 0)

    @classmethod
    def new_group(cls, timeout_s: float = 1800.0) -> TorchCollectives:
        """A gloo group over all ranks (a collective call: every rank must make it).

        Args:
            timeout_s: how long a rank waits for the others in one commit before the save fails
                (the slowest rank's write is inside that wait).
        """
        import torch.distributed as dist

        return cls(dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)))

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

    def __repr__(self) -> str:
        return f"TorchCollectives(rank={self._rank}, world_size={self._world})"
