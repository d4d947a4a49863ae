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
``local_dir`` must be one directory all ranks share (one node, or a shared file system); rank 0
finds out, and says so, when another rank's file is not there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from persist_core.distributed import Collectives
from persist_core.errors import CorruptCheckpointError, PersistError
from persist_core.layout import checkpoint_dirname
from persist_core.fileio import FileOps, commit_dir
from persist_core.format.manifest import FileEntry, Manifest
from persist_core.ownership import claim_tmp
from persist_core.tiers.local import check_files


def commit_checkpoint(
    root: Path,
    base: Manifest,
    signature: str,
    *,
    coll: Collectives,
    write_shard: Callable[[Path], FileEntry],
    release: Callable[[], None],
    ops: FileOps,
    replace: bool = False,
) -> Manifest:
    """Write this rank's shard of ``base.step`` and commit the checkpoint with the other ranks.

    Args:
        root: ``local_dir``.
        base: this rank's manifest without files; its ``tensors`` hold records for the tensors
            this rank writes and ``None`` for the others.
        signature: a digest of the state's structure; ranks must agree on it.
        coll: the job's collectives.
        write_shard: writes and fsyncs this rank's shard into the given directory.
        release: frees the staging buffer; called once, as soon as the shard is written.
        ops: file calls for the manifest.
        replace: ``step-N`` may be committed already (a re-save after a resume): the new one takes its
            name atomically and the old one is removed after (:func:`~persist_core.fileio.commit_dir`).

    Returns:
        The committed manifest (on rank 0; the other ranks get ``base``).

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
        return _commit(root, base, signature, coll=coll, write_shard=write_shard, release=release, ops=ops,
                       tmp=tmp, error=error, replace=replace)


def _commit(root: Path, base: Manifest, signature: str, *, coll: Collectives, write_shard: Callable[[Path], FileEntry],
            release: Callable[[], None], ops: FileOps, tmp: Path | None, error: BaseException | None,
            replace: bool) -> Manifest:
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
                if not leader:
                    os.makedirs(root / name, exist_ok=True)
                entry = write_shard(root / name)
            except BaseException as e:  # reported to rank 0 below, then raised here
                error = e
    finally:
        release()
    reports = coll.all_gather((entry, base.tensors if coll.world_size > 1 else None, signature,
                               None if error is None else f"{type(error).__name__}: {error}", step))
    manifest = base
    outcome: str | None = None
    if leader:
        problems = [f"rank {r}: {msg}" for r, (_, _, _, msg, _) in enumerate(reports) if msg]
        steps = [s for *_, s in reports]
        if not problems and any(s != step for s in steps):
            problems.append(
                f"the ranks saved different steps ({steps}, by rank): every rank must call save for the same steps "
                "in the same order (maybe_save agrees on them across ranks)"
            )
        if not problems and any(sig != signature for _, _, sig, _, _ in reports):
            problems.append(
                "the ranks hold states of different structure (tensor names, dtypes or shapes), so the state "
                "cannot be split between them; save on rank 0 only, or make the state the same on every rank"
            )
        if not problems:
            try:
                manifest = _merge(base, reports)
                try:
                    check_files(root / name, manifest)
                except CorruptCheckpointError as e:
                    raise PersistError(
                        f"{e}: local_dir={str(root)!r} must be one directory every rank shares (one node or a "
                        "shared file system) for all ranks to write"
                    ) from None
                commit_dir(root / name, root / checkpoint_dirname(step), manifest.to_bytes(), ops=ops,
                           replace=replace)  # the old one, if any, is left at the temporary name: removed below
            except BaseException as e:
                error = error or e
                problems.append(f"rank 0: {type(e).__name__}: {e}")
        outcome = "; ".join(problems) or None
    outcome = coll.broadcast(outcome)
    if outcome is not None and name is not None:
        shutil.rmtree(root / name, ignore_errors=True)
    if error is not None:
        if name is not None:
            error.add_note(f"while writing {root / name}")
        raise error
    if outcome is not None:
        raise PersistError(f"checkpoint step={step} was not committed: {outcome}")
    return manifest


def _merge(base: Manifest, reports: list[tuple[FileEntry, tuple | None, str, str | None, int]]) -> Manifest:
    """Rank 0's manifest with every rank's file and the records of the tensors each wrote."""
    tensors = list(base.tensors)
    for _, records, _, _, _ in reports[1:]:
        for i, record in enumerate(records or ()):
            if record is not None:
                tensors[i] = record
    missing = [i for i, t in enumerate(tensors) if t is None]
    if missing:
        raise PersistError(f"no rank wrote tensors {missing[:5]} of the state")
    return dataclasses.replace(base, world_size=len(reports), tensors=tuple(tensors),
                               files=tuple(entry for entry, *_ in reports))
