"""``Config``: everything a user configures, in one frozen, keyword-only value checked once.

The engine builds one from its keywords (``CheckpointEngine(local_dir, keep_local=..., ...)``); the adapters build
one from their flat keywords with :meth:`Config.from_keywords` (``keep_last=3, keep_every_n_steps=1000``: the
retention sugar turned into one policy, in one place). Collaborators (collectives, clocks, file operations) are
not configuration: they stay the engine's constructor arguments.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from persist_core import _knobs
from persist_core.errors import ConfigError
from persist_core.planning.sharding import check_replica_mode
from persist_core.policies.anyof import policy_from_keywords
from persist_core.policies.retention import RetentionPolicy, check_policy
from persist_core.policies.save import SavePolicy, check_save_policy
from persist_core.preemption import PreemptionNotice, check_grace
from persist_core.memory.store import MemoryTier, check_memory


@dataclass(frozen=True, kw_only=True)
class Config:
    """What one engine (or one adapter's engines) is configured with; every value checked in ``__post_init__``.

    Attributes:
        local_dir: directory of the local tier (made absolute; created by the engine if missing); ideally NVMe.
        write_threads: threads writing chunks of a shard in parallel (``None``: ``PERSIST_WRITE_THREADS`` or 4).
        chunk_bytes: bytes per write and per checksum, a multiple of 4 KiB (``None``: ``PERSIST_CHUNK_BYTES`` or
            32 MiB).
        direct_io: ``"auto"`` (``O_DIRECT`` where the file system takes it), ``"on"`` or ``"off"`` (``None``:
            ``PERSIST_DIRECT_IO`` or ``"auto"``).
        max_pending: checkpoints that may be staged or writing at once; each holds one staging buffer about the
            size of the state. With the default 1, a ``save`` while the previous write runs waits for it.
        verify: check checksums on load.
        remote_url: an fsspec URL (``s3://bucket/run-7``, ``gs://``, ``az://``, ``file://``, ``memory://``) every
            committed checkpoint is uploaded to in the background; loads fall back to it. ``None``: local only.
        storage_options: passed to fsspec as-is (``{"client_kwargs": {"endpoint_url": ...}}``).
        keep_local: retention policy for ``local_dir`` (``KeepLastN(2)``, ``AnyOf(...)``); ``None`` keeps all. The
            newest committed checkpoint, and any not yet uploaded, are never deleted.
        keep_remote: retention policy for the remote tier, applied after each upload.
        save_policy: when ``maybe_save`` saves (``Continuous(min_interval_s=30)``, ...).
        preemption: a :class:`PreemptionNotice`, ``None``, or ``"default"`` (with a ``save_policy``, the engine's
            own SIGTERM notice; see the engine).
        preemption_grace_s: how long a preemption waits for the commit and upload.
        preemption_signals: the signals an adapter's notice or flush takes for "preempted".
        remote_timeout_s: how long ``wait()``/``close()`` wait for uploads that keep failing (then one RemoteError).
        max_unsynced_bytes: the most bytes not yet uploaded that may pile up locally during an outage (``None``:
            whatever leaves 10% of ``local_dir``'s file system free).
        run_id: this run's id for its lease on ``remote_url`` (``None``: the launcher's, else one kept locally).
        torch_loadable: single-writer shards are also the zip archives ``torch.save`` writes.
        replica_check: ``"sampled"``, ``"full"`` or ``"off"``: how ranks check the tensors they save as replicated.
        start_over: a run that resumes nothing sets every committed checkpoint of both tiers aside at its first
            save, instead of being refused beside another run's remote checkpoints.
        memory: a :class:`~persist_core.memory.store.MemoryTier`: snapshots in host memory that outlives the
            process (``maybe_save`` snapshots every ``every_n_steps``; loads read the freshest source first).
        incremental: a save references the tensors whose bytes equal those of the newest committed checkpoint
            (proven by a 128-bit hash) instead of writing them again, nor uploading them.
        full_every: with ``incremental``, a full checkpoint at least every this many saves.
    """

    local_dir: Path
    write_threads: int = None  # type: ignore[assignment]  # None: resolved from the environment
    chunk_bytes: int = None  # type: ignore[assignment]
    direct_io: str = None  # type: ignore[assignment]
    max_pending: int = 1
    verify: bool = True
    remote_url: str | None = None
    storage_options: dict[str, Any] | None = None
    keep_local: RetentionPolicy | None = None
    keep_remote: RetentionPolicy | None = None
    save_policy: SavePolicy | None = None
    preemption: PreemptionNotice | None | str = "default"
    preemption_grace_s: float = 120.0
    preemption_signals: tuple[int, ...] = field(default=(signal.SIGTERM,))
    remote_timeout_s: float = 300.0
    max_unsynced_bytes: int | None = None
    run_id: str | None = None
    torch_loadable: bool = False
    replica_check: str = "sampled"
    start_over: bool = False
    memory: MemoryTier | None = None
    incremental: bool = False
    full_every: int = 10

    def __post_init__(self) -> None:
        def resolved(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        local = os.fspath(_knobs.check_local_dir(self.local_dir)).removeprefix("file://")
        resolved("local_dir", Path(local).expanduser().absolute())
        resolved("write_threads", _knobs.write_threads() if self.write_threads is None else self.write_threads)
        resolved("chunk_bytes", _knobs.chunk_bytes() if self.chunk_bytes is None else self.chunk_bytes)
        resolved("direct_io", _knobs.direct_io() if self.direct_io is None else self.direct_io)
        _knobs.check_writes(self)
        if self.keep_local is not None:
            resolved("keep_local", check_policy(self.keep_local, name="keep_local"))
        if self.keep_remote is not None:
            resolved("keep_remote", check_policy(self.keep_remote, name="keep_remote"))
            if self.remote_url is None:
                raise ConfigError("keep_remote was given without remote_url; pass remote_url='s3://...' or drop "
                                  "keep_remote")
        if self.save_policy is not None:
            check_save_policy(self.save_policy)
        if isinstance(self.preemption, str) and self.preemption != "default":
            raise ConfigError(f"preemption={self.preemption!r} must be a PreemptionNotice, None, or 'default'")
        check_grace(self.preemption_grace_s)
        if isinstance(self.preemption_signals, int):
            raise ConfigError(f"preemption_signals={self.preemption_signals!r} must be a tuple of signals, e.g. "
                              f"({self.preemption_signals!r},)")
        if not self.preemption_signals:
            raise ConfigError("preemption_signals=() is empty; pass at least one, e.g. (signal.SIGTERM,)")
        resolved("preemption_signals", _knobs.check_signals(self.preemption_signals))
        _knobs.check_bool("start_over", self.start_over)
        _knobs.check_bool("torch_loadable", self.torch_loadable)
        _knobs.check_run_id(self.run_id)
        _knobs.check_remote(self.remote_url, self.storage_options)
        check_replica_mode(self.replica_check)
        check_memory(self.memory)
        _knobs.check_incremental(self)
        if self.remote_url is not None:
            _knobs.check_backend(self.remote_url)

    @classmethod
    def from_keywords(cls, local_dir: str | os.PathLike[str], *, keep_last: int | None = None,
                      keep_every_n_steps: int | None = None, keep_every_n_seconds: float | None = None,
                      retention: RetentionPolicy | None = None, **options: Any) -> Config:
        """The adapters' flat keywords (``keep_last=3, keep_every_n_steps=1000``, or one ``retention`` policy)
        as a config: the policy is kept on both tiers (on the remote when there is one).

        Raises:
            ConfigError: a bad value (named), an unknown keyword, or ``retention`` together with a keyword.
        """
        policy = policy_from_keywords(keep_last, keep_every_n_steps, keep_every_n_seconds, retention)
        return cls.of(local_dir, **options).retaining(policy)

    def retaining(self, policy: RetentionPolicy | None) -> Config:
        """A copy keeping ``policy`` on both tiers (on the remote when there is one)."""
        return self.replace(keep_local=policy, keep_remote=policy if self.remote_url is not None else None)

    @classmethod
    def given(cls, local_dir: str | os.PathLike[str] | Config, keywords: dict[str, Any]) -> Config:
        """What ``CheckpointEngine(local_dir, **keywords)`` was given: a whole config (then no keywords), or a
        directory and options."""
        if not isinstance(local_dir, Config):
            return cls.of(local_dir, **keywords)
        if keywords:
            raise ConfigError(f"CheckpointEngine(config, {', '.join(keywords)}=...): the config holds every option; "
                              "pass config.replace(...) instead")
        return local_dir

    @classmethod
    def of(cls, local_dir: str | os.PathLike[str], **keywords: Any) -> Config:
        """``Config(local_dir=local_dir, **keywords)``, an unknown keyword a ConfigError naming the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(keywords) - known)
        if unknown:
            raise ConfigError(f"unknown option(s) {', '.join(unknown)}; the options are: {', '.join(sorted(known))}")
        return cls(local_dir=local_dir, **keywords)  # type: ignore[arg-type]  # made a Path, checked

    def replace(self, **changes: Any) -> Config:
        """A copy with ``changes``, checked again."""
        return dataclasses.replace(self, **changes)
