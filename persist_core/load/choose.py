"""Choosing what a load reads: which committed steps each source holds, which step to try first, which
source to try it from, and (several ranks) the one step every rank loads.

The restore-source order: a step is read from the first source in :data:`RESTORE_ORDER` that holds it;
a copy that does not verify passes the load to the next source that holds it (the last one's failure is
the load's). The sources are this host's memory (the memory tier, issue 42), a partner's copy, the local disk, the
remote; :func:`~persist_core.load.agree.agreed_load` has every rank agree on one step first, whichever source each
rank then reads it from. Pure.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from persist_core.errors import CheckpointNotFoundError

MEMORY = "memory"
PARTNER = "partner"
LOCAL = "local"
REMOTE = "remote"

#: Where a load looks for a step, first to last: this host's memory (a snapshot that outlived the process), the
#: partner's copy in another node's memory (pulled back, :mod:`persist_core.load.agree`), the local disk, the remote.
RESTORE_ORDER: tuple[str, ...] = (MEMORY, PARTNER, LOCAL, REMOTE)


@dataclass(frozen=True)
class Listing:
    """The committed steps each source holds, listed once (every round of :func:`agreed_load` loads from
    the same listing). A source missing from ``held`` holds nothing (no ``remote_url``, or the remote is down)."""

    held: dict[str, frozenset[int]]

    @classmethod
    def of(cls, **held: Iterable[int]) -> Listing:
        return cls({name: frozenset(held.get(name, ())) for name in RESTORE_ORDER})

    def steps(self) -> set[int]:
        """Every step some source holds."""
        return set().union(*self.held.values())

    def holds(self, source: str, step: int) -> bool:
        return step in self.held.get(source, ())

    def sources(self, step: int) -> list[str]:
        """The sources that hold ``step``, in the restore-source order."""
        return [name for name in RESTORE_ORDER if self.holds(name, step)]

    def candidates(self, step: int | None, where: str) -> list[int]:
        """The steps to try, newest first; ``[step]`` when one is asked for.

        Raises:
            CheckpointNotFoundError: ``step`` is held by no source (``where`` names them).
        """
        steps = self.steps()
        if step is None:
            return sorted(steps, reverse=True)
        if step not in steps:
            raise CheckpointNotFoundError(
                f"no committed checkpoint for step={step} in {where}; committed steps: {sorted(steps)}")
        return [step]
