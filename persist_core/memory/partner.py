"""Partner copies (issue 42 b): each rank's snapshots also go to a partner rank on another node, so a node lost with
its host memory is restored from the other node's memory rather than from disk or the remote.

A rank's partner is the rank of the same local rank on the next node (the nodes as the commit finds them out,
:func:`~persist_core.save.commit.discover_nodes`); it holds the copies under
``memory_dir/<run-id>/partner-of-rank-R/`` in the same slot-and-record format as the rank's own snapshots (a record
is written once every byte of its copy verified: a copy is whole or ignored). With one node there is no partner.

**Every rank copies the same steps.** A restore after a node loss needs one step that the surviving ranks hold in
their own memory *and* that the lost ranks' partners hold copies of. Copies that ran free, each rank sending its
newest snapshot whenever its last copy was done, gave steps that no two ranks shared once the copies lagged the
snapshots (each rank's own memory keeps only its newest slots). So the ranks agree at each snapshot step
(:meth:`PartnerCopies.agree`, one small all-gather on the training thread's channel): a step is a *copy step* when
every rank has finished the last one, both ways; the newest copy step every rank completed, both ways, is *settled*.
Each rank keeps its own slot of the settled step and of the copy step in flight (the memory tier's
:meth:`~persist_core.memory.snapshots.Snapshots.copy_committed`), and each holder keeps the settled copy while it
receives the next. What a lost node loses is the steps since the settled copy.

Who calls what: the engine's build makes :class:`PartnerCopies` (two threads, on a point-to-point channel of their
own) and gives it to the memory tier's :class:`~persist_core.memory.snapshots.Snapshots` at construction as its
:class:`CopySteps` (one node: :data:`NO_COPY_STEPS`). The conversation goes one way, so neither knows the other
through anything set later: the snapshots call :meth:`PartnerCopies.agree` at each snapshot step, on every rank
(:meth:`~persist_core.memory.snapshots.Snapshots.before`), and are *answered* with a :class:`CopyStep` (whether it is
one, and which settled step their kept slots go back to); they call :meth:`PartnerCopies.offer` with a copy step's
committed snapshot, or :meth:`PartnerCopies.skip` when there is none. ``wait()`` calls :meth:`PartnerCopies.flush`;
``close()`` calls :meth:`PartnerCopies.close`. On the wire (:mod:`persist_core.memory.wire`), per copy step::

    sender (rank R)      BEGIN, record, CHUNK..., END     (ABORT: no snapshot of that step, or closing)
    receiver (partner)   verify every byte, write the record, ACK (kept or not)
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from persist_core.distributed import Collectives, PointToPoint
from persist_core.format.manifest import Manifest
from persist_core.layout import slot_filename
from persist_core.memory.store import MemoryStore, Snapshot
from persist_core.memory.wire import ABORT, ACK, BEGIN, STOP, recv_header, recv_image, send_header, send_image

log = logging.getLogger(__name__)

DATA_TAG, ACK_TAG = 1, 2
_SLOTS = 2  # the settled copy and the one being received
_NONE = 2**62  # a direction this rank has no part in (no partner, or no source): never the one waited for


@dataclass(frozen=True)
class CopyStep:
    """The answer to :meth:`CopySteps.agree`: whether the step is a copy step (also the truth value), and the
    settled copy step the memory tier's kept slots go back to (``None``: they stay as they are; ``-1``: none is
    settled, every one goes back)."""

    copy: bool
    settled: int | None = None

    def __bool__(self) -> bool:
        return self.copy


class CopySteps(Protocol):
    """What the memory tier's snapshots say to the partner copies about copy steps (training thread, every rank at
    the same snapshot steps): 1. :meth:`agree` at each snapshot step (a collective call); 2. once a copy step's
    snapshot is committed, :meth:`offer` it, or :meth:`skip` it when there is none."""

    def agree(self, step: int) -> CopyStep: ...

    def offer(self, snap: Snapshot) -> None: ...

    def skip(self, step: int) -> None: ...


class _NoCopySteps:
    """One node (or no channel for them): no step is a copy step."""

    def agree(self, step: int) -> CopyStep:
        return CopyStep(False)

    def offer(self, snap: Snapshot) -> None:
        pass

    def skip(self, step: int) -> None:
        pass


NO_COPY_STEPS: CopySteps = _NoCopySteps()


def partners(groups: tuple[tuple[int, ...], ...], rank: int) -> tuple[int | None, int | None]:
    """``(partner, source)`` of ``rank`` among the nodes ``groups`` (each a node's ranks, in order): the rank of the
    same local rank on the next node (which holds this rank's copies), and on the previous one (whose copies this
    rank holds); ``None`` where that node has no such local rank, or there is one node."""
    if len(groups) < 2:
        return None, None
    n = next(i for i, g in enumerate(groups) if rank in g)
    local = groups[n].index(rank)
    after, before = groups[(n + 1) % len(groups)], groups[n - 1]
    return (after[local] if local < len(after) else None), (before[local] if local < len(before) else None)


class PartnerCopies:
    """This rank's side of the partner copies: a sender thread (its copy steps' snapshots to ``partner``) and a
    receiver thread (``source``'s into ``held``), on the copy steps every rank agreed on (:meth:`agree`).

    Args:
        p2p: a channel of its own (:func:`~persist_core.distributed.point_to_point`, ``background=True``).
        channel: the training thread's collectives (:func:`~persist_core.distributed.decision_channel`), for
            :meth:`agree`.
        rank: this process's rank (for the log).
        partner / source: see :func:`partners` (``None``: no such thread).
        held: where ``source``'s copies go (``memory_dir/<run-id>/partner-of-rank-<source>``).
        chunk_bytes: the size of each message (64 MiB: gloo moves a few GB/s with them).
    """

    def __init__(self, p2p: PointToPoint, channel: Collectives, *, rank: int, partner: int | None,
                 source: int | None, held: MemoryStore | None, chunk_bytes: int = 64 << 20) -> None:
        self._p2p, self._channel, self._rank, self.partner, self.source, self.held = (p2p, channel, rank, partner,
                                                                                      source, held)
        self._chunk = chunk_bytes
        self._cond = threading.Condition()
        self._offered: tuple[int, Snapshot | None] | None = None  # the copy step to send (None: say there is none)
        self._busy = False
        self._closing = False
        # the newest copy step each direction finished (whatever came of it), and completed whole; without a partner,
        # "sent" is this rank's own snapshot of it handed over (a survivor of the other node's loss needs it kept)
        self._sent = self._sent_ok = -1
        self._received = self._received_ok = -1 if source is not None and held is not None else _NONE
        self._current = -1  # the newest copy step agreed on
        self.settled = -1  # the newest copy step every rank completed whole, both ways
        self._held_steps: dict[Path, int] = {}  # the receiver's slots: the whole copy in each, by step
        self.copied_step = -1  # the newest step the partner acknowledged whole
        self._threads = []
        if partner is not None:
            self._threads.append(threading.Thread(target=self._send_loop, name="persist-partner-send", daemon=True))
        if source is not None and held is not None:
            self._threads.append(threading.Thread(target=self._receive_loop, name="persist-partner-recv", daemon=True))
        for t in self._threads:
            t.start()

    # ---- the copy steps (training thread, every rank at the same steps)

    def agree(self, step: int) -> CopyStep:
        """Whether ``step``'s snapshot is a copy step: every rank finished the last one, both ways (a collective
        call, at each snapshot step). When a new one starts, the last one is :attr:`settled` if every rank completed
        it whole, and the answer says so (the memory tier lets go of the slots kept for other copy steps). A step
        before the current copy step (the run went back to an older step) starts the copy steps over (settled: -1)."""
        settled = None
        if step < self._current:
            self._start_over(step)
            settled = -1
        votes = self._channel.all_gather(self.vote())
        if step == self._current or min(v[0] for v in votes) < self._current:
            return CopyStep(False, settled)  # this copy step again, or the last one still in flight somewhere
        with self._cond:
            if self._current >= 0 and all(v[1] in (self._current, _NONE) for v in votes):
                self.settled = self._current
            self._current = step
            self._cond.notify_all()  # the receiver picks its slot once it knows what is settled
        return CopyStep(True, self.settled)

    def _start_over(self, step: int) -> None:
        """Training thread, every rank alike: the run went back to before ``step``. The copies in flight are
        finished on every rank first (each sender's flush, then a collective call); the holder drops its copies of
        ``step`` and newer (a branch given up: the new one will have its own steps of those numbers), and the counts
        start again."""
        self.flush()
        self._channel.all_gather(None)  # every sender has its answers: every receiver is done with its copies
        with self._cond:
            self._sent = self._sent_ok = -1
            if self._received != _NONE:
                self._received = self._received_ok = -1
            self._current = self.settled = -1
            if self.held is not None:
                self.held.drop_newer(step - 1)
                self._held_steps = {p: s for p, s in self._held_steps.items() if s < step}

    def vote(self) -> tuple[int, int]:
        """What this rank says in :meth:`agree`: the newest copy step it finished both ways (whatever came of it), and
        the newest it completed whole both ways."""
        with self._cond:
            return min(self._sent, self._received), min(self._sent_ok, self._received_ok)

    # ---- the sending side

    def offer(self, snap: Snapshot) -> None:
        """The memory tier committed the snapshot of a copy step (:meth:`agree`): it goes to the partner next."""
        self._queue(snap.step, snap)

    def skip(self, step: int) -> None:
        """The copy step ``step`` has no snapshot on this rank (it failed, or the memory tier is out of room): the
        partner is told, so that every rank can go on to the next copy step."""
        self._queue(step, None)

    def _queue(self, step: int, snap: Snapshot | None) -> None:
        if self.partner is None:  # nothing to send: this rank's own part of the copy step is done
            with self._cond:
                self._sent = max(self._sent, step)
                if snap is not None:
                    self._sent_ok = max(self._sent_ok, step)
            return
        with self._cond:
            self._offered = (step, snap)
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the copy step offered has been sent (or given up for good); whether it was."""
        with self._cond:
            return self._cond.wait_for(lambda: self._closing or (self._offered is None and not self._busy), timeout)

    def _is_closing(self) -> bool:
        with self._cond:
            return self._closing

    def _send_loop(self) -> None:
        assert self.partner is not None
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._offered is not None or self._closing)
                    if self._offered is None:
                        break  # closing, nothing left to send
                    (step, snap), self._offered, self._busy = self._offered, None, True
                ok = False
                try:
                    ok = self._send(step, snap)
                finally:
                    with self._cond:
                        self._sent = max(self._sent, step)
                        if ok:
                            self._sent_ok = max(self._sent_ok, step)
                        self._busy = False
                        self._cond.notify_all()
            send_header(self._p2p, self.partner, DATA_TAG, STOP)
        except Exception as e:  # the partner's process is gone: the copies stop, training goes on
            log.warning("[rank=%d] partner copies to rank %d stopped: %s: %s", self._rank, self.partner,
                        type(e).__name__, e)
            with self._cond:
                self._closing = True
                self._cond.notify_all()

    def _send(self, step: int, snap: Snapshot | None) -> bool:
        """Send the copy step ``step`` (``snap``; ``None``: say there is none); whether the partner kept it whole."""
        assert self.partner is not None
        if snap is None:
            send_header(self._p2p, self.partner, DATA_TAG, ABORT, step)
            return False
        if not send_image(self._p2p, self.partner, DATA_TAG, snap, chunk_bytes=self._chunk, give_up=self._is_closing):
            log.debug("[rank=%d][step=%d] partner copy not sent", self._rank, step)
            return False
        op, acked, kept, _ = recv_header(self._p2p, self.partner, ACK_TAG)
        if op == ACK and kept:
            self.copied_step = max(self.copied_step, acked)
            log.debug("[rank=%d][step=%d] partner copy on rank %d complete", self._rank, acked, self.partner)
            return True
        log.warning("[rank=%d][step=%d] rank %d did not keep the partner copy", self._rank, step, self.partner)
        return False

    # ---- the receiving side

    def _receive_loop(self) -> None:
        assert self.source is not None and self.held is not None
        try:
            life = self.held.open_life()
            while True:
                header = recv_header(self._p2p, self.source, DATA_TAG)
                op, step = header[0], header[1]
                if op == STOP:
                    return
                if op != BEGIN:  # ABORT: the source has no snapshot of this copy step
                    self._received_one(step, False)
                    continue
                slot = self._slot_for(life, step)
                try:
                    self.held.drop(slot)  # its record goes before its bytes are overwritten
                except OSError as e:
                    log.warning("[rank=%d][step=%d] the partner copy's slot %s cannot be cleared: %s", self._rank,
                                step, slot, e)
                    slot = None  # received and dropped: the source still gets its answer
                ended, manifest = recv_image(self._p2p, self.source, DATA_TAG, header, slot, chunk_bytes=self._chunk)
                if not ended:  # the source could not read its slot, or is closing: no answer expected
                    self._received_one(step, False)
                    continue
                kept = manifest is not None and slot is not None and self._keep(slot, manifest, step)
                self._received_one(step, kept)
                send_header(self._p2p, self.source, ACK_TAG, ACK, step, int(kept))
        except Exception as e:  # the source's process is gone, or the tmpfs: the copies held so far stay
            if not self._closing:
                log.warning("[rank=%d] partner copies from rank %d stopped: %s: %s", self._rank, self.source,
                            type(e).__name__, e)

    def _keep(self, slot: Path, manifest: Manifest, step: int) -> bool:
        """Write the record of the copy of ``step`` received whole into ``slot``; whether it was."""
        assert self.held is not None
        try:
            self.held.commit(slot, manifest)
        except OSError as e:
            log.warning("[rank=%d][step=%d] the partner copy's record cannot be written: %s", self._rank, step, e)
            return False
        with self._cond:
            first = not self._held_steps
            self._held_steps[slot] = step
        if first:
            self.held.remove_other_lives()  # an earlier process's copies (a restart read them by now)
        log.debug("[rank=%d][step=%d] holding rank %d's partner copy", self._rank, step, self.source)
        return True

    def _slot_for(self, life: Path, step: int) -> Path:
        """The slot the copy of ``step`` goes into: never the settled copy's (a restore after a node loss needs it
        until a newer one is settled); of the others, an empty one, else the oldest. Waits until this rank's own
        :meth:`agree` has made ``step`` the current copy step (so it knows what is settled)."""
        slots = [life / slot_filename(i) for i in range(_SLOTS)]
        with self._cond:
            self._cond.wait_for(lambda: self._current >= step or self._closing)
            free = [s for s in slots if self._held_steps.get(s) != self.settled]
            slot = min(free, key=lambda s: self._held_steps.get(s, -1))
            self._held_steps.pop(slot, None)
            return slot

    def _received_one(self, step: int, kept: bool) -> None:
        with self._cond:
            self._received = max(self._received, step)
            if kept:
                self._received_ok = max(self._received_ok, step)

    def close(self, *, finished: bool, timeout: float = 30.0) -> None:
        """Send what is offered, say STOP to the partner, and wait (at most ``timeout`` s each) for the threads: the
        receiver ends at its source's STOP. ``finished``: the run ended well, the copies held go (as its own
        snapshots do); otherwise they stay for a restart."""
        self.flush(timeout)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout)
            if t.is_alive():
                log.warning("[rank=%d] the partner thread %s did not end in %.0f s", self._rank, t.name, timeout)
        if self.held is not None:  # an earlier process's copies go once this one holds a copy of its own
            with self._cond:
                received = bool(self._held_steps)
            self.held.close(remove=finished, others_up_to=None if received else -1)
