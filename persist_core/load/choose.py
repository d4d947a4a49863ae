"""Choosing what a load reads: which committed steps each source holds, which step to try first, which
source to try it from, and (several ranks) the one step every rank loads.

The restore-source order: a step is read from the first source in :data:`RESTORE_ORDER` that holds it;
a copy that does not verify passes the load to the next source that holds it (the last one's failure is
the load's). The sources are this host's memory (the memory tier, issue 42), the local disk, the remote;
:func:`agreed_load` has every rank agree on one step first, whichever source each rank then reads it from.

Pure but for :func:`agreed_load`, which makes the ranks' collective calls and the reader's reads.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from persist_core.errors import CheckpointNotFoundError, CorruptCheckpointError, PersistError

if TYPE_CHECKING:
    from persist_core.load.reader import CheckpointReader

log = logging.getLogger(__name__)

MEMORY = "memory"
LOCAL = "local"
REMOTE = "remote"

#: Where a load looks for a step, first to last: this host's memory (a snapshot that outlived the process),
#: the local disk, the remote.
RESTORE_ORDER: tuple[str, ...] = (MEMORY, LOCAL, REMOTE)


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


def agreed_load(reader: CheckpointReader, chan: Any, **kwargs: Any) -> Any:
    """The newest checkpoint every rank can get, loaded on every rank (a collective call on ``chan``, the
    training thread's channel: every rank makes it).

    Each rank says which steps it can get (its node's ``local_dir`` or the remote); they take the newest
    all have; each loads it (its own files from disk, what it lacks from the remote); if any rank cannot,
    all move on to the next one, so every rank resumes from the same step.

    Raises:
        CheckpointNotFoundError: no step every rank can load (each rank's steps named).
    """
    listing = reader._list_sources()  # listed once: each round loads from this listing
    views = chan.all_gather(sorted(listing.steps()))
    common = sorted(set.intersection(*(set(v) for v in views)), reverse=True)
    for step in common:
        state, error, mine = None, None, None
        try:
            state = reader._load_listed(step, [step], listing, **kwargs)
        except Exception as e:  # said to every rank first, so none waits for this one in the next round
            mine = e
            error = (isinstance(e, (CorruptCheckpointError, CheckpointNotFoundError)), f"{type(e).__name__}: {e}")
        said = chan.all_gather(error)
        failures = [f"rank {r}: {e[1]}" for r, e in enumerate(said) if e]
        if not failures:
            return state
        if any(not e[0] for e in said if e):  # not a copy that fails: the same call fails on the next step too
            if mine is not None:
                raise mine
            raise PersistError(f"the restore of step={step} failed on other ranks: {'; '.join(failures[:3])}")
        log.warning("[step=%d] not every rank could load it (%s); trying the next older one", step,
                    "; ".join(failures[:3]))
    if any(views):
        raise CheckpointNotFoundError(
            "no checkpoint that every rank can load: the ranks can get steps "
            + "; ".join(f"rank {r}: {v[-3:]}" for r, v in enumerate(views[:8]))
            + " (a node's local_dir lost its files and there is no remote copy?)")
    raise CheckpointNotFoundError(f"no committed checkpoint that verifies in {reader.local_dir}"
                                  + (f" nor {reader.remote_url}" if reader.remote_url else ""))
