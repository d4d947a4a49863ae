"""``build``: the parts of one :class:`~persist_core.engine.CheckpointEngine`, wired once from its
:class:`~persist_core.config.Config` and its collaborators (collectives, clocks, file operations).

The engine is a facade over what this returns: it holds no wiring of its own."""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from persist_core._knobs import check_callable
from persist_core.config import Config
from persist_core.distributed import Collectives, check_collectives, decision_channel, point_to_point
from persist_core.errors import PersistError, RemoteError
from persist_core.fileio import FileOps, OsFileOps
from persist_core.handle import ErrorLedger
from persist_core.history import SaveHistory, recent_costs
from persist_core.ownership import DirLock
from persist_core.pipeline import Pipeline
from persist_core.resumption import Resumption
from persist_core.policies.save import Clock
from persist_core.preemption import PreemptionNotice, default_notice
from persist_core.layout import parse_memory_rank_dirname
from persist_core.lineage import Lineage
from persist_core.load.reader import CheckpointReader
from persist_core.memory.files import local_dir_identity
from persist_core.memory.partner import NO_COPY_STEPS, PartnerCopies, partners
from persist_core.memory.read import PartnerLink
from persist_core.memory.slots import SlotAllocator
from persist_core.memory.snapshots import Snapshots
from persist_core.memory.store import MemoryStore
from persist_core.memory.tier import NO_MEMORY, MemorySide, NoMemory
from persist_core.run_ids import keep_run_id, kept_run_id, run_id_of
from persist_core.save.commit import Nodes, discover_nodes
from persist_core.save.overlap import Overlap
from persist_core.save.saver import Saver
from persist_core.scheduler import SaveScheduler
from persist_core.staging.pool import StagingPool
from persist_core.tiers.local import open_local_dir
from persist_core.tiers.remote import RemoteTier
from persist_core.turn import Turn

log = logging.getLogger(__name__)


class Closable(Protocol):
    """What :func:`close_at_exit` needs of an engine: its public close."""

    rank: int
    closed: bool

    def close(self, *, keep_memory: bool = False) -> None: ...


@dataclass
class Parts:
    """What an engine is made of (see :func:`build`)."""

    root: Path
    coll: Collectives
    dir_lock: DirLock
    tier: RemoteTier | None
    ledger: ErrorLedger
    history: SaveHistory
    overlap: Overlap
    pool: StagingPool
    pipeline: Pipeline
    saver: Saver
    scheduler: SaveScheduler
    reader: CheckpointReader
    own_notice: PreemptionNotice | None  # the engine's own SIGTERM notice, put back at close
    resumption: Resumption  # what this run continues from (load, resume_from, verify_resume)
    memory: MemorySide | NoMemory = NO_MEMORY  # the engine's memory calls
    snapshots: Snapshots | None = None  # the memory tier's save side

    def summary(self) -> dict[str, float | int | None]:
        """``CheckpointEngine.summary``: the history's, the overlapped saves, how far behind the remote is."""
        summary = self.history.summary()
        summary["overlapped_saves"] = self.overlap.runs
        if self.pipeline.sync is not None:
            summary.update(self.pipeline.sync.backlog())
        return summary

    def wait(self, timeout: float | None) -> None:
        """``CheckpointEngine.wait``: the guarded copy handed on, every snapshot committed (the newest one's partner
        copy sent), every save committed and uploaded; a background failure raised once (a more specific one behind
        a ``RemoteError`` first: another run's lease)."""
        self.overlap.fence()
        self.memory.wait(timeout)
        try:
            self.pipeline.drain(timeout)
        except RemoteError:
            self.ledger.raise_first()
            raise
        self.ledger.raise_first()

    def drain_and_close(self, *, finished: bool) -> None:
        """``CheckpointEngine.close``: :meth:`wait`, then :meth:`close` whatever the wait raised; a failed wait keeps
        the memory snapshots (they may be the only copy of the last steps)."""
        self.pipeline.closing = True  # a drain after giving up waits no second remote_timeout_s
        try:
            self.wait(None)
        except BaseException:
            finished = False
            raise
        finally:
            self.close(finished=finished)

    def close(self, *, finished: bool = True) -> None:
        """Put the signal back, stop the threads, release the tiers and the directory (after a drain);
        ``finished``: the run ended well (its memory snapshots go; after a failure they stay for the restart)."""
        if self.own_notice is not None:
            self.own_notice.restore()
        self.resumption.close()
        self.overlap.close()
        self.pool.close()
        self.memory.close(finished=finished, disk_step=lambda: max((c.step for c in self.reader.list()), default=-1))
        self.pipeline.close()
        if self.tier is not None:
            self.tier.close()
        self.reader.close()
        self.dir_lock.release()


def build(config: Config, *, collectives: Collectives | None, clock: Clock, wall_clock: Clock,
          file_ops: FileOps | None, wait: Callable[[float], None]) -> Parts:
    """The parts of an engine on ``config``; ``wait`` drains it (a preemption's save waits with it).

    Raises:
        ConfigError / DirectoryInUseError: as :class:`~persist_core.engine.CheckpointEngine`.
    """
    check_callable(clock=clock, wall_clock=wall_clock)
    root = config.local_dir
    coll = check_collectives(collectives)
    dir_lock = open_local_dir(root, rank=coll.rank)  # one writer per directory and rank
    overlap = Overlap(rank=coll.rank)  # its turn: the background I/O below holds off while a guarded update runs
    try:
        tier = None if config.remote_url is None else RemoteTier(config.remote_url, config.storage_options,
                                                                 turn=overlap.turn, codec=config.codec(),
                                                                 concurrency=config.remote_concurrency)
    except BaseException:
        dir_lock.release()
        raise
    ledger = ErrorLedger()
    history = SaveHistory(clock, prior=recent_costs(root))  # a restarted job: what saves cost
    # several ranks with a memory tier: which ranks share local_dir (a collective call; no save has started yet)
    nodes = None if config.memory is None or coll.world_size == 1 else discover_nodes(root, coll)
    snapshots, partner, link = None, None, None
    if config.memory is None:
        pool = StagingPool(config.max_pending, pin=torch.cuda.is_available(), turn=overlap.turn)
    else:  # the staging buffers are the memory tier's slots: the newest snapshot's, one to fill, the writes'
        snapshots, partner, link = _memory(config, root, coll, nodes, overlap.turn)
        pool = snapshots.pool
    built: list[Saver] = []  # the sync thread starts in Pipeline and may upload a backlog before the saver exists
    pipeline = Pipeline(config, pool=pool, coll=coll, ops=file_ops or OsFileOps(), ledger=ledger, tier=tier,
                        latest_step=lambda: built[0].latest_step if built else 0, turn=overlap.turn,
                        slowdown=history.meter.slowdown)
    writer = pipeline.writer
    saver = Saver(coll=coll, pool=pool, writer=writer, overlap=overlap, history=history, ledger=ledger,
                  wall_clock=wall_clock, torch_loadable=config.torch_loadable, replica_check=config.replica_check,
                  check_step=pipeline.timeline.check, check_backlog=pipeline.check_backlog, snapshots=snapshots)
    built.append(saver)
    preemption = default_notice(config.save_policy) if config.preemption == "default" else config.preemption
    assert not isinstance(preemption, str)  # Config checked it
    own_notice = preemption if preemption is not None and preemption.exit_after else None
    scheduler = SaveScheduler(policy=config.save_policy, preemption=preemption, grace_s=config.preemption_grace_s,
                              coll=coll, history=history, clock=clock, in_flight=writer.in_flight,
                              known=lambda step: step in writer.pending_steps() or history.last_step() == step,
                              wait=wait, memory_only=config.memory is not None and config.save_policy is None,
                              exits=own_notice is not None)
    # the reader tells the resumption of each load it returns (none before build returns: it is made just below)
    reader = CheckpointReader(root, verify=config.verify, tier=tier, on_loaded=lambda m: resumption.loaded(m),
                              memory=None if snapshots is None else snapshots.store)
    resumption = Resumption(root, reader=reader, coll=coll, history=history, pipeline=pipeline, saver=saver,
                            lineage=Lineage.of(root, config.run_id, world_size=coll.world_size), partner=link,
                            verify_mode=config.verify_resume, ignore=config.verify_resume_ignore)
    memory = NO_MEMORY if snapshots is None else MemorySide(snapshots, partner, saver, world_size=coll.world_size)
    return Parts(root=root, coll=coll, dir_lock=dir_lock, tier=tier, ledger=ledger, history=history, overlap=overlap,
                 pool=pool, pipeline=pipeline, saver=saver, scheduler=scheduler, reader=reader, own_notice=own_notice,
                 resumption=resumption, memory=memory, snapshots=snapshots)


def _partner(config: Config, coll: Collectives, store: MemoryStore,
             nodes: Nodes | None) -> tuple[PartnerCopies | None, PartnerLink | None]:
    """Several nodes (found out here, as the commit finds them): each rank's snapshots also go to its partner on the
    next node (:mod:`persist_core.memory.partner`), on two channels of their own, made by every rank alike. One node:
    said once, no partner."""
    if nodes is None:
        return None, None
    if len(nodes.groups) == 1:
        if coll.rank == 0:
            log.info("the memory tier's snapshots have no partner copies: every rank is on one node (one local_dir)")
        return None, None
    background = point_to_point(coll, background=True)
    restore = point_to_point(coll, background=False)
    channel = decision_channel(coll)  # the copy steps are agreed on the training thread's channel
    if background is None or restore is None or channel is None:
        log.warning("[rank=%d] %d nodes, but the collectives make no point-to-point channel: no partner copies "
                    "(pass TorchCollectives.new_group())", coll.rank, len(nodes.groups))
        return None, None
    partner, source = partners(nodes.groups, coll.rank)
    assert config.memory is not None
    run_id = store.root.parent.name
    held = None if source is None else config.memory.partner_store(run_id, source, layout=nodes.groups)
    log.info("[rank=%d] memory snapshots are copied to rank %s on the next node; this rank holds rank %s's",
             coll.rank, partner, source)
    copies = PartnerCopies(background, channel, rank=coll.rank, partner=partner, source=source, held=held)
    return copies, PartnerLink(restore, source=source, held=held, scratch=store.root)


def _memory(config: Config, root: Path, coll: Collectives, nodes: Nodes | None,
            turn: Turn) -> tuple[Snapshots, PartnerCopies | None, PartnerLink | None]:
    """The memory tier for ``config.memory``, each part given what it uses as it is made (the store, its slots, the
    staging pool of them, the partner copies, the snapshots): this rank's snapshots under ``<run-id>/rank-R``.
    Several ranks (``nodes``: which share ``local_dir``) take rank 0's run id (a collective call); the first rank of
    each node keeps it in its ``local_dir``, where that keeps another (a replaced node's fresh disk)."""
    assert config.memory is not None
    if coll.world_size > 1:  # rank 0's (made in its local_dir at first use); each node's first rank keeps it too
        run_id = coll.broadcast(run_id_of(root, config.run_id) if coll.rank == 0 else None)  # no save has started yet
        if nodes is not None and nodes.groups[nodes.mine][0] == coll.rank and kept_run_id(root, strict=False) != run_id:
            keep_run_id(root, run_id)  # a replaced node's fresh disk: a reader there finds the run (one writer)
    else:
        run_id = run_id_of(root, config.run_id)
        if config.run_id is not None:
            keep_run_id(root, run_id)  # where a CheckpointReader(local_dir, memory=...) looks for this run's snapshots
    assert config.memory is not None
    store = config.memory.store(run_id, coll.rank, root, local_dir_identity(root, create=True))
    _say_unused_ranks(store.root.parent, coll)
    allocator = SlotAllocator(store, slots=_slots(config, nodes), pin=torch.cuda.is_available(),
                              on_full=_on_full(config, coll))
    pool = StagingPool(_slots(config, nodes), pin=False, turn=turn, allocator=allocator)
    partner, link = _partner(config, coll, store, nodes)
    snapshots = Snapshots(config.memory, store, allocator, pool, copy_steps=NO_COPY_STEPS if partner is None
                          else partner, turn=turn, chunk_bytes=config.chunk_bytes, rank=coll.rank)
    return snapshots, partner, link


def _slots(config: Config, nodes: Nodes | None) -> int:
    """The memory tier's slots: the newest snapshot's, one to fill, one per disk write in flight; with several nodes
    two more, the copy steps' (the settled one and the one in flight: :mod:`persist_core.memory.partner`)."""
    return config.max_pending + 2 + (2 if nodes is not None and len(nodes.groups) > 1 else 0)


def _on_full(config: Config, coll: Collectives) -> Callable[..., None]:
    """What the slots say once they cannot be had: the memory tier saves to disk only."""
    assert config.memory is not None
    base = config.memory.base

    def full(why: str, *, unusable: bool = False) -> None:
        if unusable:  # what is wrong with the directory, and its fix, was said where it was found
            log.warning("[rank=%d] the memory tier cannot use its directory (%s): saving to disk only", coll.rank, why)
            return
        log.warning("[rank=%d] the memory tier has too little room (%s): saving to disk only; give %s more room "
                    "(docker run --shm-size=...) or pass MemoryTier(memory_dir=...) a larger tmpfs", coll.rank, why,
                    base)
    return full


def _say_unused_ranks(run_dir: Path, coll: Collectives) -> None:
    """Rank 0, once: the snapshots of ranks this run does not have (a resume with fewer processes) are not used."""
    if coll.rank != 0:
        return
    try:
        ranks = sorted(r for r in (parse_memory_rank_dirname(p.name) for p in run_dir.iterdir())
                       if r is not None and r >= coll.world_size)
    except OSError:
        return
    if ranks:
        log.warning("the memory snapshots of ranks %s in %s are not used: this run has %d rank(s), so it reads only "
                    "ranks below %d (a resume with as many ranks as saved reads them; `persist gc --memory` removes "
                    "the run's snapshots no live process holds)", ranks, run_dir, coll.world_size, coll.world_size)


def close_at_exit(engine: Closable) -> None:
    """Drain ``engine`` when the interpreter exits with it still open: pending writes commit and
    queued uploads finish, instead of dying with the thread pools (a weak reference, so an
    engine that is dropped is not kept alive). Runs before concurrent.futures stops its workers.
    """
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        return
    ref = weakref.ref(engine)

    def close() -> None:
        live = ref()
        if live is not None and not live.closed:
            try:
                live.close(keep_memory=True)  # not closed by the program: its memory snapshots stay
            except PersistError as e:
                log.error("[rank=%d] at exit: %s", live.rank, e)

    register(close)
