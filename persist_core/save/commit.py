"""The commit protocol: how the staged parts of one checkpoint become a committed directory.

Every rank calls :func:`commit_checkpoint` for the same step, in the same order (the engine's
writer thread does, one save after another). With one process the collectives return at once
and the protocol is the classic one: shard, fsync, manifest, fsync, rename, fsync the parent.

::

    rank 0       mark + mkdir local_dir/.tmp-step-N-pid-token   -> broadcast its name (ownership.claim_tmp)
    every rank   write + fsync rank-R.safetensors in it         -> all_gather (file entry, records, step, or error)
    rank 0       all ranks ok, the same step and state structure? every file there with its size?
                 write + fsync manifest.json, rename to step-N, fsync local_dir
                                                                -> broadcast the outcome
    any failure on any rank: no manifest, the temporary directory removed, every rank's save fails

Every rank makes every collective call even after a failure of its own, so none waits forever.

Several nodes, each with its own ``local_dir`` (found out at the first save, :func:`discover_nodes`):
each node's leader claims the temporary name on its own disk and its ranks write there; rank 0
decides as above and broadcasts the merged manifest (which records the ranks of each node); each
leader checks its node's files, writes its node's copy of the manifest and renames; if any node
cannot, the others take theirs back, so nothing is committed anywhere (a kill between two nodes'
renames leaves a step some node lacks: restore agreement never picks it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from dataclasses import dataclass
from typing import NamedTuple

from persist_core.distributed import Collectives
from persist_core.errors import CorruptCheckpointError, PersistError
from persist_core.layout import checkpoint_dirname, node_probe_filename
from persist_core.fileio import FileOps, commit_dir, exchange_dirs
from persist_core.format.manifest import FileEntry, Manifest
from persist_core.format.tree import tensor_paths
from persist_core.ownership import claim_tmp, discard
from persist_core.tiers.local import check_files

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Nodes:
    """Which ranks share one ``local_dir`` (found out by :func:`discover_nodes`, never configured).

    Attributes:
        groups: the ranks of each node, each ascending, ordered by their first rank (the node's leader).
        mine: the index of this rank's node.
        rank: this rank.
    """

    groups: tuple[tuple[int, ...], ...]
    mine: int
    rank: int

    @property
    def shared(self) -> bool:
        """Every rank writes into one directory (one node, or a shared file system)."""
        return len(self.groups) == 1

    @property
    def leader(self) -> bool:
        """This rank commits its node's copy (the first rank of its node)."""
        return self.groups[self.mine][0] == self.rank


def discover_nodes(root: Path, coll: Collectives) -> Nodes:
    """Find out which ranks see the same ``root`` (a collective call: every rank makes it, in order).

    Each rank writes a probe file named by a token rank 0 draws; once all have written, each lists the
    probes it sees; ranks that see the same set share a directory (a node, or a shared file system).

    Raises:
        PersistError: the ranks' views do not split into groups (a directory some ranks share only in
            part): ``local_dir`` must be one per node or one for all.
    """
    if coll.world_size == 1:
        return Nodes(groups=((0,),), mine=0, rank=0)
    token = coll.broadcast(secrets.token_hex(8) if coll.rank == 0 else None)
    probe = root / node_probe_filename(token, coll.rank)
    error: str | None = None
    try:
        probe.write_bytes(b"")
    except OSError as e:
        error = f"rank {coll.rank} could not write {probe}: {e}"
    errors = [e for e in coll.all_gather(error) if e]  # every rank has written its probe (or failed to)
    try:
        seen = tuple(r for r in range(coll.world_size) if (root / node_probe_filename(token, r)).exists())
    except OSError:
        seen = ()
    views = coll.all_gather(seen)  # every rank has looked
    probe.unlink(missing_ok=True)
    problems = [f"rank {r} sees the probes of ranks {list(v)}" for r, v in enumerate(views)
                if r not in v or any(views[o] != v for o in v)]
    if problems:
        raise PersistError(f"the ranks' local_dir={str(root)!r} do not split into nodes: {'; '.join(errors + problems[:4])}. "
                           "Give every node its own local_dir (node-local disks), or all ranks one shared directory")
    groups = tuple(sorted(set(views), key=lambda g: g[0]))
    return Nodes(groups=groups, mine=next(i for i, g in enumerate(groups) if coll.rank in g), rank=coll.rank)


def commit_checkpoint(
    root: Path,
    base: Manifest,
    signature: str,
    *,
    digests: list[int | None] | None = None,
    coll: Collectives,
    write_shard: Callable[[Path], FileEntry],
    release: Callable[[], None],
    ops: FileOps,
    replace: bool = False,
    nodes: Nodes | None = None,
) -> Manifest:
    """Write this rank's shard of ``base.step`` and commit the checkpoint with the other ranks.

    Args:
        root: ``local_dir``.
        base: this rank's manifest without files; its ``tensors`` hold records for the tensors
            this rank writes and ``None`` for the others.
        signature: a digest of the state's structure; ranks must agree on it.
        digests: per tensor, a digest of a tensor every rank takes to hold alike (``None``: sharded);
            ranks must agree on each (a mismatch names the tensor and the ranks).
        coll: the job's collectives.
        write_shard: writes and fsyncs this rank's shard into the given directory.
        release: frees the staging buffer; called once, as soon as the shard is written.
        ops: file calls for the manifest.
        replace: ``step-N`` may be committed already (a re-save after a resume): the new one takes its
            name atomically and the old one is removed after (:func:`~persist_core.fileio.commit_dir`).
        nodes: which ranks share ``root`` (:func:`discover_nodes`); ``None``: all of them. With
            several nodes each node's leader commits its node's copy on its own disk.

    Returns:
        The committed manifest (on rank 0, and on every rank with several nodes: its node's copy;
        the other ranks of one directory get ``base``).

    Raises:
        The exception of this rank's own failure, or :class:`PersistError` naming the rank
        that failed; nothing is committed then.
    """
    with contextlib.ExitStack() as owned:
        tmp, error = None, None
        if coll.rank == 0:
            try:  # owned (alive) until renamed into place or removed, even when this process dies
                tmp = owned.enter_context(claim_tmp(root, base.step))
            except OSError as e:  # still make every collective call below, so no rank waits forever
                error = e
        split = nodes is not None and not nodes.shared
        return _commit(root, base, signature, digests or [], coll=coll, write_shard=write_shard, release=release,
                       ops=ops, tmp=tmp, error=error, replace=replace, nodes=nodes if split else None, owned=owned)


def _commit(root: Path, base: Manifest, signature: str, digests: list[int | None], *, coll: Collectives, write_shard: Callable[[Path], FileEntry],
            release: Callable[[], None], ops: FileOps, tmp: Path | None, error: BaseException | None,
            replace: bool, nodes: Nodes | None, owned: contextlib.ExitStack) -> Manifest:
    step = base.step
    leader = coll.rank == 0
    name: str | None = None
    entry: FileEntry | None = None
    try:
        name = coll.broadcast(None if tmp is None else tmp.name)
        if name is None:
            error = error or PersistError(f"rank 0 could not create a temporary directory in {root}")
        else:
            try:
                if not leader and nodes is not None and nodes.leader:  # its node's copy: owned here
                    owned.enter_context(claim_tmp(root, step, name))
                elif not leader:
                    os.makedirs(root / name, exist_ok=True)
                entry = write_shard(root / name)
            except BaseException as e:  # reported to rank 0 below, then raised here
                error = e
    finally:
        release()
    try:
        reports = [Report(*r) for r in coll.all_gather((
            entry, base.tensors if coll.world_size > 1 else None, signature,
            None if error is None else f"{type(error).__name__}: {error}", step, base.per_rank, digests))]
    except Exception as e:  # the process group broke (a rank died mid-write): whatever the backend raises
        raise PersistError(
            f"checkpoint step={step} was not committed: the ranks could not gather their reports ({type(e).__name__}: "
            f"{e}); another rank died or left the process group while writing. Nothing was committed; the previous "
            "checkpoint is intact") from e
    manifest = base
    outcome: str | None = None
    if leader:
        problems = [f"rank {r}: {rep.error}" for r, rep in enumerate(reports) if rep.error]
        steps = [rep.step for rep in reports]
        if not problems and any(s != step for s in steps):
            problems.append(
                f"the ranks saved different steps ({steps}, by rank): every rank must call save for the same steps "
                "in the same order (maybe_save agrees on them across ranks)"
            )
        if not problems and any(rep.signature != signature for rep in reports):
            problems.append(
                "the ranks hold states of different structure (tensor names, dtypes or shapes), so the state "
                "cannot be split between them; save on rank 0 only, or make the state the same on every rank"
            )
        if not problems:
            problems += _replica_mismatches(base, reports)
        if not problems:
            try:
                manifest = _merge(base, reports)
                if nodes is not None:  # each node's leader checks and commits its own copy, below
                    manifest = dataclasses.replace(manifest, nodes=nodes.groups)
                else:
                    try:
                        check_files(root / name, manifest)
                    except CorruptCheckpointError as e:
                        raise PersistError(
                            f"{e}: rank 0 does not see a file another rank wrote into local_dir={str(root)!r}"
                        ) from None
                    commit_dir(root / name, root / checkpoint_dirname(step), manifest.to_bytes(), ops=ops,
                               replace=replace)  # the old one, if any, is left at the temporary name: removed below
            except BaseException as e:
                error = error or e
                problems.append(f"rank 0: {type(e).__name__}: {e}")
        outcome = "; ".join(problems) or None
    if nodes is None:
        outcome = coll.broadcast(outcome)
    else:
        outcome, merged = coll.broadcast((outcome, manifest if outcome is None else None))
        if outcome is None:
            manifest, outcome = _commit_node(root, name, merged.placed(nodes.mine), coll=coll, nodes=nodes, ops=ops,
                                             replace=replace)
    if outcome is not None and name is not None:
        shutil.rmtree(root / name, ignore_errors=True)
    if error is not None:
        if name is not None:
            error.add_note(f"while writing {root / name}")
        raise error
    if outcome is not None:
        raise PersistError(f"checkpoint step={step} was not committed: {outcome}")
    return manifest


def _commit_node(root: Path, name: str, manifest: Manifest, *, coll: Collectives, nodes: Nodes, ops: FileOps,
                 replace: bool) -> tuple[Manifest, str | None]:
    """Each node's leader commits its node's copy; if any node cannot, the others take theirs back.

    Returns ``(this node's manifest, None)``, or ``(…, what failed)`` with nothing left committed.
    """
    final = root / checkpoint_dirname(manifest.step)
    failure: str | None = None
    committed = exchanged = False
    if nodes.leader:
        try:
            check_files(root / name, manifest)
            exchanged = replace and os.path.lexists(final)
            commit_dir(root / name, final, manifest.to_bytes(), ops=ops, replace=replace)
            committed = True
        except BaseException as e:
            failure = f"node {nodes.mine} (ranks {list(nodes.groups[nodes.mine])}): {type(e).__name__}: {e}"
    failures = [f for f in coll.all_gather(failure) if f]
    if not failures:
        return manifest, None
    if committed:  # another node could not commit: take this node's copy back (the old one back in place)
        try:
            if exchanged:
                exchange_dirs(root / name, final)
            else:
                discard(root, final)
        except OSError as e:
            log.error("[step=%d] could not take back this node's copy %s after another node failed: %s",
                      manifest.step, final, e)
    # every rank waits for its node's take-back: the temporary name holds the old copy until the leader has put it
    # back, and the caller removes that name on every rank
    coll.all_gather(None)
    return manifest, "; ".join(failures)


class Report(NamedTuple):
    """What each rank tells rank 0 after writing its shard."""

    entry: FileEntry | None
    records: tuple | None  # its manifest records (None for what others wrote); None with one rank
    signature: str
    error: str | None
    step: int
    per_rank: tuple
    digests: list[int | None]


def _replica_mismatches(base: Manifest, reports: list[Report]) -> list[str]:
    """One problem naming the tensors taken to be replicated whose digests differ between ranks (the first few,
    each with the ranks that differ from rank 0), then the fix, once; ``[]`` when they all agree."""
    if len(reports) < 2 or not reports[0].digests:
        return []
    paths = tensor_paths(base.tree)
    found = []
    for i, mine in enumerate(reports[0].digests):
        if mine is None:
            continue
        differ = [r for r, rep in enumerate(reports) if rep.digests[i] != mine]
        if differ:
            found.append(f"state[{paths[i]!r}] (ranks {differ})")
    if not found:
        return []
    named = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
    return [f"{len(found)} plain tensor(s) are taken to be replicated but hold other values than rank 0: {named}. "
            "Saving them would mix the ranks' data. If they are sharded, save the DTensor itself (not .to_local()); "
            "if they differ per rank on purpose, wrap them in persist_core.PerRank(...)"]


def _merge(base: Manifest, reports: list[Report]) -> Manifest:
    """Rank 0's manifest with every rank's file, the records of the tensors each wrote (the chunks of
    sharded ones from every rank) and each rank's PerRank values."""
    tensors = list(base.tensors)
    for rep in reports[1:]:
        for i, record in enumerate(rep.records or ()):
            if record is None:
                continue
            if record.chunks is not None:
                tensors[i] = dataclasses.replace(tensors[i], chunks=(*tensors[i].chunks, *record.chunks))
            else:
                tensors[i] = record
    missing = [i for i, t in enumerate(tensors) if t is None]
    if missing:
        raise PersistError(f"no rank wrote tensors {missing[:5]} of the state")
    for i, t in enumerate(tensors):
        if t.chunks is not None and sum(math.prod(c.sizes) for c in t.chunks) != math.prod(t.shape):
            held = sum(math.prod(c.sizes) for c in t.chunks)
            raise PersistError(
                f"state[{tensor_paths(base.tree)[i]!r}] is sharded {t.placements} over a mesh of {list(t.mesh or ())} "
                f"but the ranks' parts hold {held} of its {math.prod(t.shape)} elements: every rank of its mesh must "
                "save with one engine whose collectives span them (collectives=TorchCollectives.new_group())")
    return dataclasses.replace(base, world_size=len(reports), tensors=tuple(tensors),
                               files=tuple(rep.entry for rep in reports),
                               per_rank=tuple(rep.per_rank[0] if rep.per_rank else () for rep in reports)
                               if base.per_rank else ())
