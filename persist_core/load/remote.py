"""Bringing a checkpoint only the remote holds onto this machine, for :class:`~persist_core.load.reader.CheckpointReader`.

Two ways: :meth:`RemoteRestore.stream` reads it by ranged, verified requests straight into the state's tensors
(no file written and read back first) and writes each run of blocks into a local copy, which a thread commits
into ``local_dir`` afterwards for the next restore; :meth:`RemoteRestore.download` puts it into ``local_dir``
whole (``fetch``: the CLI's ``pull`` and ``cp``). Either way the files go into an owned temporary directory
first and are renamed into place as a writer commits: a failure or a kill leaves nothing a reader takes.

An incremental checkpoint (its manifest ``depends_on()`` others, issue 43) is read with its references resolved
against the remote's manifests (:func:`~persist_core.load.references.resolve`): the entries it references are read
by ranged requests from the referenced checkpoints' files, every block verified, each byte once. A streamed one leaves
a local copy only when every checkpoint it references is committed locally as the same checkpoint (else the copy
would name bytes that are not there: the engine's next save is then a full one); ``fetch`` brings what it references
first.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from persist_core import _link_knobs
from persist_core.errors import CorruptCheckpointError, PersistError, WriteError
from persist_core.fileio import fsync_dir
from persist_core.format.manifest import Manifest
from persist_core.layout import checkpoint_dirname
from persist_core.ownership import claim_tmp
from persist_core.assembly.assemble import load_checkpoint, load_into
from persist_core.assembly.blocks import LoadStats, read_shard
from persist_core.load.local_copy import LocalCopy
from persist_core.assembly.plan import LoadOptions
from persist_core.load.references import read_referenced, referenced_file, resolve, split_name
from persist_core.tiers.local import LocalTier, checkpoint_dir, committed_steps, read_manifest
from persist_core.tiers.remote import RemoteTier

log = logging.getLogger(__name__)


class RemoteRestore:
    """Remote-only checkpoints of ``tier`` brought into ``root``; ``pool`` decodes the tensors."""

    def __init__(self, root: Path, tier: RemoteTier, pool: ThreadPoolExecutor) -> None:
        self._root = root
        self._tier = tier
        self._pool = pool
        self._copies: list[threading.Thread] = []  # committing the local copies of streamed restores

    def fill(self, step: int, into: Any, opts: LoadOptions, stats: LoadStats) -> tuple[Any, Manifest]:
        """``(into filled by ranged reads of step's files, the manifest)``; the bytes read counted in ``stats``."""
        tier = self._tier
        manifest = tier.read_manifest(step)

        def remote_blocks(f: Any, first: int, views: list[memoryview]) -> None:
            tier.read_blocks(step, f, first, views, verify=opts.verify)
            stats.count_remote(sum(len(v) * v.itemsize for v in views), f.name)

        where = f"{tier.url}/{checkpoint_dirname(step)}"
        if manifest.depends_on():  # the referenced entries by ranged reads of the older checkpoints' files
            manifest, names, _ = self._resolve(manifest, where)
            remote_blocks = referenced_file(names, remote_blocks, self._referenced_blocks(opts, stats))
        state = load_into(manifest, into, pool=self._pool, options=opts, where=where, stats=stats,
                          read_blocks=remote_blocks)
        return state, manifest

    def _resolve(self, manifest: Manifest, where: str) -> tuple[Manifest, set[str], dict[int, Manifest]]:
        """``manifest``'s references resolved against the remote's manifests: the resolved manifest, the referenced
        files' names in it, and the manifests of the checkpoints it references."""
        held: dict[int, Manifest] = {}

        def manifest_of(ref: int) -> Manifest:
            held[ref] = self._tier.read_manifest(ref)
            return held[ref]

        resolved, names = resolve(manifest, manifest_of, where=where)
        return resolved, names, held

    def _referenced_blocks(self, opts: LoadOptions, stats: LoadStats) -> Callable[[str, Any, int, list[memoryview]],
                                                                                 None]:
        """Reads blocks of a referenced file (``step-N/<file>`` in a resolved manifest) from the remote, verified."""
        def read(name: str, f: Any, first: int, views: list[memoryview]) -> None:
            ref, fname = split_name(name)
            self._tier.read_blocks(ref, dataclasses.replace(f, name=fname), first, views, verify=opts.verify)
            stats.count_remote(sum(len(v) * v.itemsize for v in views), name)

        return read

    def _copies_safely(self, held: dict[int, Manifest]) -> bool:
        """Every checkpoint a referencing one references (``held``: the remote's manifests) is committed locally as
        the same checkpoint: a local copy of the referencing one would read."""
        try:
            return all(read_manifest(checkpoint_dir(self._root, ref)) == m for ref, m in held.items())
        except (CorruptCheckpointError, PersistError, OSError):
            return False

    def fetch(self, step: int, progress: Any) -> bool:
        """Download ``step`` (verified) into ``root``, after the checkpoints it references that ``root`` lacks;
        ``False`` when the remote does not hold it."""
        if step not in self._tier.committed_steps():
            return False
        local = set(committed_steps(self._root))
        for ref in sorted(self._tier.read_manifest(step).depends_on() - local):
            log.info("[step=%d] downloading step %d first: it references bytes there", step, ref)
            self.download(ref, progress)
        self.download(step, progress)
        return True

    def stream(self, step: int, opts: LoadOptions, stats: LoadStats) -> tuple[Any, Manifest]:
        """``(the state, its manifest)``, streamed (see the module); what it read is counted in ``stats``."""
        tier = self._tier
        manifest = tier.read_manifest(step)
        name = f"{tier.url}/{checkpoint_dirname(step)}"
        whole, others, copies = manifest, {}, True
        if manifest.depends_on():  # the referenced entries first, by ranged reads; the own files streamed below
            whole, names, held = self._resolve(manifest, name)
            others = read_referenced(whole, names, pool=self._pool, stats=stats, read_blocks=referenced_file(
                names, lambda f, first, views: None, self._referenced_blocks(opts, stats)))
            copies = self._copies_safely(held)
            if not copies:
                log.info("[step=%d] no local copy of it: it references step(s) %s, not all committed in %s", step,
                         sorted(held), self._root)
        copy = LocalCopy(self._root, manifest) if copies else None

        def shard(f: Any) -> Any:
            def fill(blocks: list[tuple[list[memoryview], int, int | None, int]]) -> None:
                views = [v for vs, _, _, _ in blocks for v in vs]
                tier.read_blocks(step, f, blocks[0][3], views, verify=opts.verify)
                stats.count_remote(sum(len(v) for v in views), f.name)
                if copy is not None:
                    copy.write(f, blocks[0][3], views)

            return read_shard(f, head=lambda n: tier.read_range(step, f, 0, n), fill=fill, pool=requests,
                              verify=opts.verify, where=f"{name}/{f.name}", span_bytes=span)

        own = [f for f in whole.files if f.name not in others]
        span = _link_knobs.remote_span_bytes(sum(f.size for f in own), tier.concurrency)  # every connection busy
        try:  # as many requests in flight as the tier's uploads and downloads have, every file's at once
            with ThreadPoolExecutor(tier.concurrency, thread_name_prefix="persist-stream") as requests, \
                    ThreadPoolExecutor(max(1, min(len(own), tier.concurrency)), thread_name_prefix="persist-file") as files:
                pending = {f.name: files.submit(shard, f) for f in own}  # (file by file, each tail left them idle)
                state = load_checkpoint(name, whole, pool=self._pool, options=opts,
                                        shard=lambda f: others[f.name] if f.name in others else pending[f.name].result())
        except BaseException:
            if copy is not None:
                copy.abandon()
            raise
        log.info("[step=%d] streamed from %s (%d bytes)", step, tier.url, stats.remote_bytes)
        if copy is None:
            return state, whole
        # not a daemon: a script that loads and ends still commits (or removes) the copy before the interpreter goes
        thread = threading.Thread(target=copy.finish, name="persist-local-copy", daemon=False)
        thread.start()
        self._copies.append(thread)
        return state, whole

    def wait_copies(self) -> None:
        """Wait until the local copies that streamed restores write are committed."""
        while self._copies:
            self._copies.pop().join()

    def download(self, step: int, progress: Callable[[int], None] | None = None) -> Manifest:
        """Download ``step`` into ``root`` and rename it into place (or take another process's copy).

        Raises:
            WriteError: writing into ``root`` failed (a full disk: its ``errno`` is ``ENOSPC``); the message names
                the path, and nothing is left there.
            RemoteError, CorruptCheckpointError: as :meth:`RemoteTier.download`.
        """
        ckpt = checkpoint_dir(self._root, step)
        where = self._root
        try:
            with claim_tmp(self._root, step) as tmp:
                where = tmp
                manifest = self._tier.download(step, tmp, progress)
                try:
                    os.rename(tmp, ckpt)
                    fsync_dir(self._root)
                    log.info("[step=%d] downloaded from %s into %s", step, self._tier.url, ckpt)
                except OSError as e:
                    if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                        raise
                    # another process (a rank on this node) put its download in place first: use that one
                    manifest = read_manifest(ckpt)
        except PersistError:
            raise
        except OSError as e:  # the remote's failures are RemoteErrors: this one is the local disk's
            space = " (free space there, or pass another local_dir)" if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
            raise WriteError(e.errno, f"downloading step {step} from {self._tier.url} into {e.filename or where} "
                                      f"failed: {e.strerror or e}{space}; nothing was committed in {self._root}") from e
        return manifest


def set_aside_here(root: Path, tier: RemoteTier, remote_only: set[int],
                   read_manifest_or_none: Callable[[int], Manifest | None]) -> set[int]:
    """Of ``remote_only`` (steps only ``tier`` holds), those that are checkpoints ``root`` set aside (a run died
    before the remote followed its branch): the remote's copy is the same manifest as the one set aside here."""
    found = set()
    for step, _, manifest, _ in LocalTier(root).abandoned_manifests():
        if step not in remote_only:
            continue
        try:
            same = read_manifest_or_none(step) == manifest
        except CorruptCheckpointError:
            same = False  # not the same checkpoint, whatever it is: load() judges it as usual
        if same:
            log.warning("[step=%d] not loading it from %s: this directory set it aside (an abandoned branch)", step,
                        tier.url)
            found.add(step)
    return found
