"""``CheckpointReader``: list and load committed checkpoints of a local tier and its remote.

A load goes list -> choose -> read -> verify -> assemble: the reader lists what each source holds and picks
the step and the source in the restore-source order (:mod:`~persist_core.load.choose`), then reads it by verified runs of blocks (:mod:`~persist_core.assembly.blocks`, the ranges from
:mod:`~persist_core.assembly.plan`) into the state (:mod:`~persist_core.assembly.assemble`); a checkpoint only the
remote holds is streamed (:mod:`~persist_core.load.remote`).

It never writes a checkpoint, uploads or deletes one, so any number of processes (every rank of
a job, a CLI, an evaluation job) may read the same ``local_dir`` and ``remote_url`` while one
:class:`~persist_core.CheckpointEngine` writes there. The one thing it adds to ``local_dir`` is a
checkpoint downloaded from the remote, put in place with a rename exactly as a writer commits
(:mod:`persist_core.load.remote`, :mod:`persist_core.load.local_copy`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from persist_core import _knobs
from persist_core.errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError, RemoteError
from persist_core.ownership import discard
from persist_core.format.manifest import Manifest
from persist_core.assembly.assemble import load_into, read_copy
from persist_core.assembly.blocks import LoadStats, node_copy_blocks
from persist_core.load.paths import step_named
from persist_core.load.choose import LOCAL, MEMORY, PARTNER, REMOTE, Listing
from persist_core.assembly.plan import LoadOptions, check_weights_only
from persist_core.load.references import load_referencing
from persist_core.load.remote import RemoteRestore, set_aside_here
from persist_core.load import sources
from persist_core.load.sources import MemoryOption, Pulled
from persist_core.tiers.remote import RemoteTier
from persist_core.tiers.local import LocalTier, checkpoint_dir, committed_steps, discover, read_manifest
from persist_core.tiers.codec import Codec, SecretKey
from persist_core.tiers.tier import CheckpointInfo, HostReader

log = logging.getLogger(__name__)

T = TypeVar("T")


class CheckpointReader:
    """Read-only access to the checkpoints under ``local_dir`` and ``remote_url``.

    Example::

        with CheckpointReader("/nvme/ckpt", remote_url="s3://bucket/run-7") as reader:
            state = reader.load()                  # newest that verifies, local first
            steps = [c.step for c in reader.list("all")]
        # leaving the block commits the local copy a load streamed from the remote wrote (close() does)

    Args:
        local_dir: the local tier (created if missing; downloads land here).
        remote_url: an fsspec URL of the remote tier, or ``None``.
        storage_options: passed to fsspec as-is.
        remote_encryption_key: the key the remote was written with (32 bytes or a callable), if it is encrypted.
        verify: check crc32c checksums on load (default True).
        tier: an already open :class:`RemoteTier` to share (the engine passes its own).
        on_loaded: called with the manifest each :meth:`load` returns (the engine warms its staging buffers).
        memory: the run's :class:`~persist_core.MemoryTier` (its snapshots are read first when they are the
            freshest; the run is the one ``local_dir`` keeps the id of), or the snapshots themselves (the engine's
            store: a :class:`~persist_core.tiers.tier.HostReader`, each slot a copy of its own).

    Raises:
        ConfigError: ``local_dir`` cannot be created, or the remote URL cannot be used.
    """

    def __init__(
        self,
        local_dir: str | os.PathLike[str],
        *,
        remote_url: str | None = None,
        storage_options: dict[str, Any] | None = None,
        verify: bool = True,
        tier: RemoteTier | None = None,
        on_loaded: Callable[[Manifest], None] | None = None,
        memory: MemoryOption | HostReader | None = None,
        remote_encryption_key: Any = None,
    ) -> None:
        self._root = Path(os.fspath(_knobs.check_local_dir(local_dir)).removeprefix("file://")).expanduser().absolute()
        if tier is None:
            _knobs.check_remote(remote_url, storage_options)
        try:
            self._root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"local_dir={str(self._root)!r} cannot be created ({e.strerror or e}); pass a usable directory") from e
        self._verify = _knobs.check_bool("verify", verify)
        self._owns_tier = tier is None and remote_url is not None
        key = remote_encryption_key and SecretKey(remote_encryption_key)
        self._tier = tier or (RemoteTier(remote_url, storage_options, codec=Codec(None, key)) if remote_url else None)
        self._pool = ThreadPoolExecutor(_knobs.write_threads(), thread_name_prefix="persist-read")
        self._restore = RemoteRestore(self._root, self._tier, self._pool) if self._tier is not None else None
        self.loaded_step: int | None = None  # the step the last successful load() returned (a resume point)
        self.loaded_from_remote = False  # ... and it was downloaded (a fresh machine resuming the remote's run)
        self.loaded_source: str | None = None  # ... and the source it was read from (load/choose.py's names)
        self.last_load = LoadStats()  # what the last load(into=...) needed and read
        self._on_loaded = on_loaded
        self._manifest: Manifest | None = None  # the manifest the last read went by
        # (step, into, options) -> state, by the disk's and the remote's flows; memory's and a partner's copies: _copies
        self._reads: dict[str, Callable[[int, Any, LoadOptions], Any]] = {LOCAL: self._local, REMOTE: self._remote}
        self.pulled: Pulled | None = None  # a partner's copy pulled back for this load (load/agree.py)
        if isinstance(memory, MemoryOption):
            memory = memory.reads(self._root)
        elif memory is not None and not isinstance(memory, HostReader):
            raise _knobs.memory_type_error(memory)
        self._memory: HostReader | None = memory
        self._disk = LocalTier(self._root)

    @property
    def local_dir(self) -> Path:
        return self._root

    @property
    def remote_url(self) -> str | None:
        return None if self._tier is None else self._tier.url

    def close(self) -> None:
        """Release threads (and the remote tier if this reader opened it), once the local copies that
        streamed restores write are committed. Idempotent."""
        self.wait_copies()
        self._pool.shutdown(wait=True)
        if self._owns_tier and self._tier is not None:
            self._tier.close()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # ------------------------------------------------------------------ listing

    def list(self, tier: str = "local") -> list[CheckpointInfo]:
        """Committed checkpoints whose manifest and file sizes check, oldest first.

        Args:
            tier: ``"local"``, ``"remote"``, or ``"all"`` (both, each with its ``tier``).

        Raises:
            ConfigError: an unknown tier, or ``"remote"`` without a ``remote_url``.
        """
        if tier not in ("local", "remote", "all"):
            raise ConfigError(f"tier={tier!r} must be 'local', 'remote' or 'all'")
        if tier == "remote" and self._tier is None:
            raise ConfigError("tier='remote' needs a remote_url")
        local = [info for info, _ in discover(self._root)] if tier != "remote" else []
        remote = []
        if tier == "remote":
            remote = self._tier.list()
        elif tier == "all" and self._tier is not None:
            remote = self._remote_or_nothing(self._tier.list, [])
        return sorted(local + remote, key=lambda i: (i.step, i.tier))

    def abandoned(self, tier: str = "local") -> list[CheckpointInfo]:
        """Checkpoints set aside because a run resumed from an older one and saved past it (``"local"``,
        ``"remote"`` or ``"all"``): kept, never pruned, never the latest; ``persist ls`` shows them."""
        if tier not in ("local", "remote", "all"):
            raise ConfigError(f"tier={tier!r} must be 'local', 'remote' or 'all'")
        found = LocalTier(self._root).abandoned() if tier in ("local", "all") else []
        if tier in ("remote", "all") and self._tier is not None:
            found += self._tier.abandoned()
        return found

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint: the local copy when there is one, else the remote's; with a memory
        tier, its newest snapshot when that is newer still (``tier="memory"``, ``path`` its slot, which
        :meth:`step_of` and ``load`` understand)."""
        newest: dict[int, CheckpointInfo] = {}
        for info in self.list("all" if self._tier is not None else "local"):
            if info.step not in newest or info.tier == "local":
                newest[info.step] = info
        snap = None if self._memory is None else sources.newest(self._memory, newer_than=max(newest, default=-1))
        if snap is not None:
            return snap
        return newest[max(newest)] if newest else None

    def memory_steps(self, *, whole: bool = False) -> set[int]:
        """The steps of the memory snapshots this reader can read (none without a memory tier); ``whole``: those a
        whole load can read (a rank's part of sharded tensors loads into targets only)."""
        return set() if self._memory is None else sources.held_steps(self._memory, whole=whole)

    def memory_step(self, path: str | os.PathLike[str]) -> int | None:
        """The step of the memory snapshot whose slot ``path`` names (as :meth:`latest` gives it), or ``None``."""
        return None if self._memory is None else sources.step_at(self._memory, path)

    def step_of(self, path: str | os.PathLike[str]) -> int:
        """The step of a checkpoint named by its local directory, a link to it (or to its single
        shard file, as the Lightning plugin's paths are), or its remote URL.

        Raises:
            CheckpointNotFoundError: ``path`` does not name a checkpoint of this reader's tiers.
        """
        text = os.fspath(path).rstrip("/")
        in_memory = self.memory_step(text)
        if in_memory is not None:
            return in_memory
        return step_named(text, self._root, None if self._tier is None else self._tier.url)

    # ------------------------------------------------------------------ loading

    def load(self, step: int | None = None, *, into: Any = None, map_location: Any = "cpu",
             verify: bool | None = None, rank: int = 0, weights_only: bool = True) -> Any:
        """Load the newest committed checkpoint that verifies, or the one for ``step``.

        Without ``into``, the whole state: the local copy when it is there and verifies; otherwise
        the remote copy is streamed straight into the tensors (parallel ranged reads, checksums verified; the
        bytes read are written into a local copy alongside, committed into ``local_dir`` after the load)
        and loaded. Sharded tensors come back whole (consolidated).

        With ``into`` (a state shaped like the saved one, e.g. ``{"model": msd, "optim": osd}`` from
        ``get_state_dict`` on the new mesh), its tensors and ``DTensor`` s are filled in place: each
        rank reads only the byte ranges the part it holds overlaps, in parallel, every checksum
        block it touches verified — from the local files when they are there and verify, else by
        ranged reads from the remote (nothing downloaded whole). Any number of ranks, any mesh.

        Args:
            step: which checkpoint; ``None`` takes the newest one that verifies, logging a
                warning for each newer one it skips.
            into: targets to fill in place (see above); saved tensors without one are read whole.
            map_location: device for the tensors read whole (``"cpu"`` default, ``"cuda:0"``, ...).
            verify: check checksums (default: the reader's ``verify``).
            rank: whose ``PerRank`` values to return (the engine passes its own rank).
            weights_only: unpickle non-tensor leaves with an allowlist of the types training states
                hold (the default, as ``torch.load`` spells it: a crafted leaf runs no code);
                ``False``: full pickle, for checkpoints you trust.

        Returns:
            An object equal to the saved state (its tensors being ``into``'s where it had them).

        Raises:
            CheckpointNotFoundError: nothing committed (for ``step``) on any tier.
            CorruptCheckpointError: no copy of ``step`` verifies (names the file).
            UnsafeCheckpointError: a leaf names a type outside the allowlist (names it and the opt-in).
            ConfigError: a bad argument (named); a target of another shape than saved, or one the checkpoint lacks.
        """
        step = None if step is None else _knobs.check_step(step)
        order, listing = self._candidates(step, whole=into is None)
        return self._load_listed(step, order, listing, into=into, map_location=map_location, verify=verify,
                                 rank=rank, weights_only=weights_only)

    def _load_listed(self, step: int | None, order: list[int], listing: Listing, *, into: Any = None,
                     map_location: Any = "cpu", verify: bool | None = None, rank: int = 0,
                     weights_only: bool = True) -> Any:
        """:meth:`load`, trying the steps of ``order`` in turn, each from the sources ``listing`` says hold it."""
        opts = LoadOptions(verify=self._verify if verify is None else _knobs.check_bool("verify", verify),
                           map_location=_knobs.check_map_location(map_location),
                           rank=_knobs.check_step(rank, name="rank", what="whose PerRank values to load"),
                           weights_only=check_weights_only(weights_only))
        _knobs.check_into(into)
        for candidate in order:
            try:
                state, source = self._read(candidate, listing.sources(candidate), into, opts)
            except CorruptCheckpointError as e:
                if step is not None:
                    raise
                log.warning("[step=%d] skipping: %s", candidate, e)
                continue
            self.loaded_step, self.loaded_from_remote, self.loaded_source = candidate, source == REMOTE, source
            if self._on_loaded is not None and self._manifest is not None:
                self._on_loaded(self._manifest)
            return state
        where = f"{self._root}" + (f" nor {self._tier.url}" if self._tier else "")
        raise CheckpointNotFoundError(f"no committed checkpoint that verifies in {where}")

    def _list_sources(self, *, whole: bool = False) -> Listing:
        """The committed steps of each source (a remote that cannot be read holds none; a remote step this
        directory set aside is not the remote's to give; ``whole``: for a whole load)."""
        local = set(committed_steps(self._root))
        remote = set(self._remote_or_nothing(self._tier.committed_steps, [])) if self._tier is not None else set()
        remote -= self._set_aside_here(remote - local)
        return Listing.of(**{LOCAL: local, REMOTE: remote, MEMORY: self.memory_steps(whole=whole)})

    def _candidates(self, step: int | None, *, whole: bool = False) -> tuple[list[int], Listing]:
        """The steps to try, newest first (``[step]`` when given), and what each source holds."""
        listing = self._list_sources(whole=whole)
        where = f"{self._root}" + (f" or {self._tier.url}" if self._tier else "")
        return listing.candidates(step, where), listing

    def _read(self, step: int, held_by: list[str], into: Any, opts: LoadOptions) -> tuple[Any, str]:
        """``(the state, the source it was read from)``: from the first of ``held_by`` (in the restore-source
        order) whose copy verifies."""
        self.last_load = LoadStats()
        for i, source in enumerate(held_by):
            try:
                if source in self._reads:
                    return self._reads[source](step, into, opts), source
                return self._copies(source, step, into, opts), source
            except CorruptCheckpointError as e:
                if i + 1 == len(held_by):
                    raise
                self._passed_over(source, step, e, whole=into is None)
        raise CheckpointNotFoundError(f"no source holds step={step}")  # not reached: listed steps have one

    def _copies(self, source: str, step: int, into: Any, opts: LoadOptions) -> Any:
        """The state from the first copy of ``step`` that ``source`` was given whose bytes verify
        (:func:`~persist_core.load.sources.read_copies`)."""
        given = self._memory if source == MEMORY else None if self.pulled is None else self.pulled.copy
        state, self._manifest = sources.read_copies([] if given is None else given.copies(step), step, into,
                                                    what=source, options=opts, pool=self._pool, stats=self.last_load)
        return state

    def _passed_over(self, source: str, step: int, error: CorruptCheckpointError, *, whole: bool) -> None:
        """``source``'s copy of ``step`` did not verify; the next source (the disk, the remote) is read instead."""
        if source in (MEMORY, PARTNER):
            log.warning("[step=%d] the %s copy does not verify (%s); reading the next copy", step, source, error)
            self.last_load = LoadStats()
            return
        assert source == LOCAL and self._tier is not None
        if whole:
            log.warning("[step=%d] local copy does not verify (%s); downloading from %s", step, error, self._tier.url)
            self._set_aside(checkpoint_dir(self._root, step))
        else:
            log.warning("[step=%d] local copy does not verify (%s); reading from %s", step, error, self._tier.url)
            self.last_load = LoadStats()

    def _blocks(self, ckpt: Path, manifest: Manifest, opts: LoadOptions) -> Callable[..., None]:
        """``read_blocks`` for a local copy (:func:`~persist_core.assembly.blocks.node_copy_blocks`)."""
        return node_copy_blocks(ckpt, manifest, self._tier, verify=opts.verify, stats=self.last_load)

    def _local(self, step: int, into: Any, opts: LoadOptions) -> Any:
        """The state from the local copy: ``into`` filled in place, or whole (a node's copy: this node's files
        from disk, the others' streamed from the remote)."""
        ckpt = checkpoint_dir(self._root, step)
        self._manifest = manifest = read_manifest(ckpt)
        if manifest.depends_on():
            return self._local_referencing(ckpt, manifest, into, opts)
        if into is not None or manifest.elsewhere():
            return load_into(manifest, {} if into is None else into, pool=self._pool, options=opts, where=str(ckpt),
                             stats=self.last_load, read_blocks=self._blocks(ckpt, manifest, opts))
        return read_copy(self._disk, step, manifest, None, options=opts, pool=self._pool, stats=self.last_load,
                         where=str(ckpt))

    def _local_referencing(self, ckpt: Path, manifest: Manifest, into: Any, opts: LoadOptions) -> Any:
        """The state of a local incremental checkpoint (:func:`~persist_core.load.references.load_referencing`)."""
        state, self._manifest = load_referencing(self._root, ckpt, manifest, into, options=opts, pool=self._pool,
                                                 stats=self.last_load, read_own=self._blocks(ckpt, manifest, opts))
        return state

    def _remote(self, step: int, into: Any, opts: LoadOptions) -> Any:
        """The state from the remote: ``into`` filled by ranged reads, or streamed whole (a local copy left)."""
        assert self._tier is not None and self._restore is not None
        if into is None:
            state, self._manifest = self._restore.stream(step, opts, self.last_load)
            return state
        state, self._manifest = self._restore.fill(step, into, opts, self.last_load)
        return state

    def wait_copies(self) -> None:
        """Wait until the local copies that streamed restores write are committed (``close()`` does)."""
        if self._restore is not None:
            self._restore.wait_copies()

    def fetch(self, step: int, progress: Callable[[int], None] | None = None) -> Path:
        """Make ``local_dir`` hold checkpoint ``step``, downloading it (verified) if it is not there.

        Returns:
            The local checkpoint directory.

        Raises:
            CheckpointNotFoundError: ``step`` is on neither tier.
            CorruptCheckpointError: the remote copy does not verify.
            ConfigError: ``step`` is not a step.
        """
        step = _knobs.check_step(step)
        ckpt = checkpoint_dir(self._root, step)
        if step in committed_steps(self._root):
            read_manifest(ckpt)  # its files are there with their sizes
            return ckpt
        if self._restore is None or not self._restore.fetch(step, progress):
            raise CheckpointNotFoundError(f"no committed checkpoint for step={step} in {self._root}"
                                          + (f" or {self._tier.url}" if self._tier else ""))
        return ckpt

    def _set_aside_here(self, remote_only: set[int]) -> set[int]:
        """Remote steps that are checkpoints this directory set aside (a run died before the remote followed)."""
        tier = self._tier
        if tier is None or not remote_only:
            return set()
        return set_aside_here(self._root, tier, remote_only,
                              lambda step: self._remote_or_nothing(lambda: tier.read_manifest(step), None))

    def _remote_or_nothing(self, read: Callable[[], T], nothing: T) -> T:
        """``read()`` from the remote, or ``nothing`` when the remote is down: local copies still serve."""
        try:
            return read()
        except RemoteError as e:
            log.warning("the remote tier cannot be read (%s); using %s alone", e, self._root)
            return nothing

    def _set_aside(self, ckpt: Path) -> None:
        """Move a copy that failed verification out of the way with one rename (then delete it)."""
        discard(self._root, ckpt)

