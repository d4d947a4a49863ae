"""Several ranks restoring together: every rank loads one step, the newest every rank can get, from its fastest
source — its own memory, its partner's copy in another node's memory (pulled back over the wire), its node's disk,
the remote (:data:`~persist_core.load.choose.RESTORE_ORDER`).

Every rank makes every collective call of :func:`agreed_load`, in the same order, whatever it holds (a rank with
nothing still gathers, still walks the pulls): none ever waits for a call another rank skipped.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

from persist_core.errors import CheckpointNotFoundError, CorruptCheckpointError, PersistError
from persist_core.load.choose import MEMORY, PARTNER, Listing
from persist_core.load.sources import Pulled

if TYPE_CHECKING:
    from persist_core.load.reader import CheckpointReader

log = logging.getLogger(__name__)


class Partner(Protocol):
    """What a restore through the partner copies needs (the memory tier's
    :class:`~persist_core.memory.read.PartnerLink`): the steps this rank holds for another, and the pulls of one
    step walked on every rank alike (each rank's own pulled copy back, or ``None``)."""

    def held_steps(self, *, whole: bool = False) -> dict[int, list[int]]: ...

    def exchange(self, pulls: list[tuple[int, int]], step: int, rank: int) -> Pulled | None: ...


def agreed_load(reader: CheckpointReader, chan: Any, partner: Partner | None = None, **kwargs: Any) -> Any:
    """The newest checkpoint every rank can get, loaded on every rank (a collective call on ``chan``, the training
    thread's channel, and on ``partner.p2p``: every rank makes them).

    Each rank says which steps it can get (its memory, its node's ``local_dir``, the remote) and which it holds for
    another rank as its partner; a rank can get what it holds or its partner holds for it. They take the newest all
    can get; a rank whose memory lacks it and whose partner holds it pulls the partner's copy (every byte verified);
    each loads it from its first source; if any rank cannot, all move on to the next older step.

    Raises:
        CheckpointNotFoundError: no step every rank can load (each rank's steps named).
    """
    whole = kwargs.get("into") is None
    listing = reader._list_sources(whole=whole)  # listed once: each round loads from this listing
    held = {} if partner is None else partner.held_steps(whole=whole)
    views = chan.all_gather((sorted(listing.steps()), sorted(listing.held.get(MEMORY, ())), held))
    holders = {q: (r, set(steps)) for r, (_, _, h) in enumerate(views) for q, steps in h.items()}
    gets = [set(v[0]) | holders.get(r, (None, set()))[1] for r, v in enumerate(views)]
    common = sorted(set.intersection(*gets), reverse=True)
    for step in common:
        # who pulls a partner's copy of step: every rank works it out alike from what all said
        pulls = [(holders[r][0], r) for r, v in enumerate(views)
                 if step not in v[1] and r in holders and step in holders[r][1]]
        state, error, mine, pulled = None, None, None, None
        try:
            pulled = None if partner is None else partner.exchange(pulls, step, chan.rank)
            here = listing if pulled is None else Listing({**listing.held, PARTNER: frozenset({step})})
            reader.pulled = pulled
            state = reader._load_listed(step, [step], here, **kwargs)
        except Exception as e:  # said to every rank first, so none waits for this one in the next round
            mine = e
            error = (isinstance(e, (CorruptCheckpointError, CheckpointNotFoundError)), f"{type(e).__name__}: {e}")
        finally:
            reader.pulled = None
            if pulled is not None:
                pulled.discard()
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
    if any(g for g in gets):
        raise CheckpointNotFoundError(
            "no checkpoint that every rank can load: the ranks can get steps "
            + "; ".join(f"rank {r}: {sorted(g)[-3:]}" for r, g in enumerate(gets[:8]))
            + " (a node's local_dir and memory lost and there is no remote copy?)")
    raise CheckpointNotFoundError(f"no committed checkpoint that verifies in {reader.local_dir}"
                                  + (f" nor {reader.remote_url}" if reader.remote_url else ""))
