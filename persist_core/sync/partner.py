"""Partner copies (issue 42 b): each rank's newest memory snapshot also goes to a partner rank on another node, so a
node lost with its host memory is restored from the other node's memory rather than from disk or the remote.

A rank's partner is the rank of the same local rank on the next node (the nodes as the commit finds them out,
:func:`~persist_core.save.commit.discover_nodes`); it holds the copies under
``memory_dir/<run-id>/partner-of-rank-R/`` in the same slot-and-record format as the rank's own snapshots (a record
is written once every byte of its copy verified: a copy is whole or ignored). With one node there is no partner.

Who calls what: the engine's build makes :class:`PartnerCopies` (two threads, on a point-to-point channel of their
own); the memory tier's commit thread calls :meth:`PartnerCopies.offer` with each committed snapshot; ``wait()``
calls :meth:`PartnerCopies.flush`; ``close()`` calls :meth:`PartnerCopies.close`. On the wire
(:mod:`persist_core.tiers.wire`), per copy::

    sender (rank R)      BEGIN, record, CHUNK..., END      (ABORT instead of a chunk: a newer snapshot came)
    receiver (partner)   verify every byte, write the record, ACK (kept or not)

Newest wins: the sender gives up a copy in flight as soon as a newer snapshot is offered. So after a node is lost,
what its ranks lose is the steps since their last completed partner copy.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from persist_core.distributed import PointToPoint
from persist_core.layout import slot_filename
from persist_core.tiers.memory import MemoryStore, Snapshot
from persist_core.tiers.wire import ACK, BEGIN, STOP, recv_header, recv_image, send_header, send_image

log = logging.getLogger(__name__)

DATA_TAG, ACK_TAG = 1, 2
_SLOTS = 2  # the newest whole copy and the one being received


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
    """This rank's side of the partner copies: a sender thread (its newest snapshot to ``partner``) and a receiver
    thread (``source``'s snapshots into ``held``).

    Args:
        p2p: a channel of its own (:func:`~persist_core.distributed.point_to_point`, ``background=True``).
        rank: this process's rank (for the log).
        partner / source: see :func:`partners` (``None``: no such thread).
        held: where ``source``'s copies go (``memory_dir/<run-id>/partner-of-rank-<source>``).
        chunk_bytes: the size of each message (64 MiB: gloo moves a few GB/s with them).
    """

    def __init__(self, p2p: PointToPoint, *, rank: int, partner: int | None, source: int | None,
                 held: MemoryStore | None, chunk_bytes: int = 64 << 20) -> None:
        self._p2p, self._rank, self.partner, self.source, self.held = p2p, rank, partner, source, held
        self._chunk = chunk_bytes
        self._cond = threading.Condition()
        self._offered: Snapshot | None = None  # the newest snapshot not sent yet
        self._busy = False
        self._closing = False
        self.copied_step = -1  # the newest step the partner acknowledged whole
        self.abandoned = 0  # copies given up for a newer snapshot
        self._threads = []
        if partner is not None:
            self._threads.append(threading.Thread(target=self._send_loop, name="persist-partner-send", daemon=True))
        if source is not None and held is not None:
            self._threads.append(threading.Thread(target=self._receive_loop, name="persist-partner-recv", daemon=True))
        for t in self._threads:
            t.start()

    # ---- the sending side

    def offer(self, snap: Snapshot) -> None:
        """The memory tier committed ``snap``: it is the one to copy next (an older one not sent yet is dropped,
        one in flight given up)."""
        if self.partner is None:
            return
        with self._cond:
            self._offered = snap
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the newest snapshot offered has been sent (or given up for good); whether it was."""
        with self._cond:
            return self._cond.wait_for(lambda: self._closing or (self._offered is None and not self._busy), timeout)

    def _newer(self) -> bool:
        with self._cond:
            return self._offered is not None or self._closing

    def _send_loop(self) -> None:
        assert self.partner is not None
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._offered is not None or self._closing)
                    if self._offered is None:
                        break  # closing, nothing left to send
                    snap, self._offered, self._busy = self._offered, None, True
                try:
                    self._send(snap)
                finally:
                    with self._cond:
                        self._busy = False
                        self._cond.notify_all()
            send_header(self._p2p, self.partner, DATA_TAG, STOP)
        except Exception as e:  # the partner's process is gone: the copies stop, training goes on
            log.warning("[rank=%d] partner copies to rank %d stopped: %s: %s", self._rank, self.partner,
                        type(e).__name__, e)
            with self._cond:
                self._closing = True
                self._cond.notify_all()

    def _send(self, snap: Snapshot) -> None:
        assert self.partner is not None
        if not send_image(self._p2p, self.partner, DATA_TAG, snap, chunk_bytes=self._chunk, newer=self._newer):
            self.abandoned += 1
            log.debug("[rank=%d][step=%d] partner copy given up for a newer snapshot", self._rank, snap.step)
            return
        op, step, kept, _ = recv_header(self._p2p, self.partner, ACK_TAG)
        if op == ACK and kept:
            self.copied_step = max(self.copied_step, step)
            log.debug("[rank=%d][step=%d] partner copy on rank %d complete", self._rank, step, self.partner)
        else:
            log.warning("[rank=%d][step=%d] rank %d did not keep the partner copy", self._rank, step, self.partner)

    # ---- the receiving side

    def _receive_loop(self) -> None:
        assert self.source is not None and self.held is not None
        newest: Path | None = None  # the slot of the newest whole copy
        try:
            life = self.held.open_life()
            while True:
                header = recv_header(self._p2p, self.source, DATA_TAG)
                op, step = header[0], header[1]
                if op == STOP:
                    return
                if op != BEGIN:
                    continue  # an ABORT between copies
                slot = next(life / slot_filename(i) for i in range(_SLOTS) if life / slot_filename(i) != newest)
                self.held.drop(slot)  # its record goes before its bytes are overwritten
                ended, manifest = recv_image(self._p2p, self.source, DATA_TAG, header, slot, chunk_bytes=self._chunk)
                if not ended:
                    continue  # given up for a newer snapshot: no answer expected
                kept = manifest is not None
                if manifest is not None:
                    self.held.commit(slot, manifest)
                    if newest is None:
                        self.held.remove_other_lives()  # an earlier process's copies (a restart read them by now)
                    newest = slot
                    log.debug("[rank=%d][step=%d] holding rank %d's partner copy", self._rank, step, self.source)
                send_header(self._p2p, self.source, ACK_TAG, ACK, step, int(kept))
        except Exception as e:  # the source's process is gone, or the tmpfs: the copies held so far stay
            if not self._closing:
                log.warning("[rank=%d] partner copies from rank %d stopped: %s: %s", self._rank, self.source,
                            type(e).__name__, e)

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
        if self.held is not None:
            self.held.close(remove=finished)
