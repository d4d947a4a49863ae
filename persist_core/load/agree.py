"""Several ranks restoring together: every rank loads one step, the newest every rank can get, from its fastest
source — its own memory, its partner's copy in another node's memory (pulled back over the wire), its node's disk,
the remote (:data:`~persist_core.load.choose.RESTORE_ORDER`).

Every rank makes every collective call of :func:`agreed_load`, in the same order, whatever it holds (a rank with
nothing still gathers, still walks the pulls): none ever waits for a call another rank skipped.
"""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from persist_core.distributed import PointToPoint
from persist_core.errors import CheckpointNotFoundError, CorruptCheckpointError, PersistError
from persist_core.layout import pulled_filename
from persist_core.load.choose import MEMORY, PARTNER, Listing
from persist_core.tiers.memory import MemoryStore, Snapshot
from persist_core.tiers.wire import BEGIN, NONE, recv_header, recv_image, send_header, send_image

if TYPE_CHECKING:
    from persist_core.load.reader import CheckpointReader

log = logging.getLogger(__name__)

_PULL_TAG = 3


@dataclass(frozen=True)
class PartnerLink:
    """What a rank needs to restore through the partner copies.

    Args:
        p2p: a channel of its own for the restore's messages (the training thread's).
        source: the rank whose copies this rank holds (``None``: none), in ``held``.
        held: ``memory_dir/<run-id>/partner-of-rank-<source>``.
        scratch: where a copy pulled back goes while it is read (this rank's memory directory).
        chunk_bytes: the size of each message.
    """

    p2p: PointToPoint
    source: int | None
    held: MemoryStore | None
    scratch: Path
    chunk_bytes: int = 64 << 20

    def held_steps(self, *, whole: bool = False) -> dict[int, list[int]]:
        """``{source: the steps held for it}`` (empty without a source); ``whole``: those a whole load can read (a
        rank's part of sharded tensors loads into targets only)."""
        if self.source is None or self.held is None:
            return {}
        return {self.source: sorted({s.step for s in self.held.snapshots() if not whole or s.manifest.part is None})}


def agreed_load(reader: CheckpointReader, chan: Any, partner: PartnerLink | None = None, **kwargs: Any) -> Any:
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
            pulled = None if partner is None else _exchange(partner, pulls, step, chan.rank)
            here = listing if pulled is None else Listing({**listing.held, PARTNER: frozenset({step})})
            reader.pulled = pulled
            state = reader._load_listed(step, [step], here, **kwargs)
        except Exception as e:  # said to every rank first, so none waits for this one in the next round
            mine = e
            error = (isinstance(e, (CorruptCheckpointError, CheckpointNotFoundError)), f"{type(e).__name__}: {e}")
        finally:
            reader.pulled = None
            if pulled is not None:
                pulled.path.unlink(missing_ok=True)
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


def _exchange(partner: PartnerLink, pulls: list[tuple[int, int]], step: int, rank: int) -> Snapshot | None:
    """Walk ``pulls`` (``(holder, puller)``, the same list on every rank), one at a time: a holder sends its copy of
    ``step`` (``NONE`` when it has none now), its puller receives it into a file of its own. The copy this rank
    pulled (verified), or ``None``."""
    pulled = None
    for holder, puller in pulls:
        if rank not in (holder, puller):
            continue
        if rank == holder:  # it always answers, so its puller never waits for nothing
            try:
                snap = _held_snapshot(partner, step)
            except OSError as e:
                log.warning("[rank=%d][step=%d] the partner copies cannot be listed: %s", rank, step, e)
                snap = None
            if snap is None:
                send_header(partner.p2p, puller, _PULL_TAG, NONE, step)
            else:
                send_image(partner.p2p, puller, _PULL_TAG, snap, chunk_bytes=partner.chunk_bytes)
            continue
        header = recv_header(partner.p2p, holder, _PULL_TAG)
        if header[0] != BEGIN:
            log.warning("[rank=%d][step=%d] rank %d no longer holds the partner copy", rank, step, holder)
            continue
        path: Path | None = partner.scratch / pulled_filename(secrets.token_hex(8))
        try:
            partner.scratch.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:  # the image is still received (and dropped): the holder never waits
            log.warning("[rank=%d][step=%d] no room for a pulled partner copy in %s: %s", rank, step, partner.scratch, e)
            path = None
        _, manifest = recv_image(partner.p2p, holder, _PULL_TAG, header, path, chunk_bytes=partner.chunk_bytes)
        if manifest is None or path is None:
            if path is not None:
                path.unlink(missing_ok=True)
            continue
        pulled = Snapshot(manifest, path)
        log.info("[rank=%d][step=%d] pulled the partner copy back from rank %d (%d bytes)", rank, step, holder,
                 os.path.getsize(path))
    return pulled


def _held_snapshot(partner: PartnerLink, step: int) -> Snapshot | None:
    if partner.held is None:
        return None
    return next((s for s in partner.held.snapshots() if s.step == step), None)
