"""``Config``: every option, written once: its type, default and one line of docs, in one frozen, keyword-only value
checked once.

The engine builds one from its keywords (``CheckpointEngine(local_dir, keep_local=..., ...)``) or takes one whole;
the adapters build one from their flat keywords with :meth:`Config.from_keywords` (``keep_last=3,
keep_every_n_steps=1000``, ``memory_every_n_steps=1``: the sugar of :data:`SUGAR` turned into Config values, in one
place). :data:`ENTRY_POINTS` says which entry point takes which option, and :func:`keyword_options` shows them to
``inspect.signature`` and ``help()`` as named, annotated keywords with these defaults and docs: a new option is a
field here (and a name in :data:`ENTRY_POINTS` for the adapters that take it), nothing else. Collaborators
(collectives, clocks, file operations) are not configuration: they stay the engine's constructor arguments.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
import signal
import textwrap
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from persist_core import _knobs, _link_knobs
from persist_core.errors import ConfigError
from persist_core.planning.sharding import check_replica_mode
from persist_core.policies.anyof import policy_from_keywords
from persist_core.policies.retention import RetentionPolicy, check_policy
from persist_core.policies.save import SavePolicy, check_save_policy
from persist_core.preemption import PreemptionNotice, check_grace
from persist_core.memory.option import MemoryTier, check_memory, memory_tier
from persist_core.tiers.codec import Codec, SecretKey, check_compression

T = TypeVar("T", bound=type)


def _option(default: Any, doc: str, *, accepts: Any = None) -> Any:
    """A field's default and its one line of docs; ``accepts``: the type a caller may pass where it is wider than
    the checked value's (``None`` resolved from the environment, a ``str`` made a ``Path``)."""
    return field(default=default, metadata={"doc": doc, "accepts": accepts})


@dataclass(frozen=True, kw_only=True)
class Config:
    """What one engine (or one adapter's engines) is configured with; every value checked in ``__post_init__``.

    Example: ``CheckpointEngine(Config(local_dir="/nvme/ckpt", remote_url="s3://bucket/run-7"))``;
    ``config.replace(max_pending=2)`` is a copy, checked again.
    """

    local_dir: Path = field(metadata={"accepts": str | os.PathLike[str], "doc": (
        "directory of the local tier (created if missing; made absolute), ideally on NVMe.")})
    write_threads: int = _option(None, accepts=int | None, doc=(
        "threads writing the chunks of one shard in parallel (``None``: ``PERSIST_WRITE_THREADS`` or 4)."))
    chunk_bytes: int = _option(None, accepts=int | None, doc=(
        "bytes per write and per checksum, a multiple of 4 KiB (``None``: ``PERSIST_CHUNK_BYTES`` or 32 MiB)."))
    direct_io: str = _option(None, accepts=str | None, doc=(
        "``\"auto\"`` (``O_DIRECT`` where the file system takes it), ``\"on\"`` or ``\"off\"`` (``None``: "
        "``PERSIST_DIRECT_IO`` or ``\"auto\"``)."))
    max_pending: int = _option(1, (
        "checkpoints that may be staged or writing at once, each holding a host copy of the state about its size; "
        "with 1, a save while the previous one writes waits for it."))
    verify: bool = _option(True, "check checksums on load.")
    remote_url: str | None = _option(None, (
        "an fsspec URL (``s3://bucket/run-7``, ``gs://``, ``az://``, ``file://``, ``memory://``) every committed "
        "checkpoint is uploaded to in the background; loads fall back to it. ``None``: local only."))
    storage_options: dict[str, Any] | None = _option(None, (
        "passed to fsspec as-is: endpoint, credentials (``{\"client_kwargs\": {\"endpoint_url\": ...}}``)."))
    keep_local: RetentionPolicy | None = _option(None, (
        "retention policy for ``local_dir`` (``KeepLastN(2)``, ``AnyOf(...)``); ``None`` keeps all. The newest "
        "committed checkpoint, and any not yet uploaded, are never deleted."))
    keep_remote: RetentionPolicy | None = _option(None, (
        "retention policy for the remote tier, applied after each upload; ``None`` keeps all."))
    save_policy: SavePolicy | None = _option(None, (
        "when ``maybe_save`` saves (``Continuous(min_interval_s=30)``, ``EveryNSteps(1000)``, "
        "``OptimalInterval(mtbf_s=...)``). With one, a preemption signal only sets a flag: the next ``maybe_save`` "
        "saves on every process and flushes within ``preemption_grace_s``, and ``preempted`` tells the loop to stop."))
    preemption: PreemptionNotice | None | str = _option("default", (
        "a :class:`PreemptionNotice`, ``None``, or ``\"default\"`` (with a ``save_policy``, the engine's own notice "
        "of ``preemption_signals``)."))
    preemption_grace_s: float = _option(120.0, (
        "on a preemption signal, how long to wait for the pending checkpoint to commit and upload before the "
        "process goes on exiting (SIGKILL usually follows)."))
    preemption_signals: tuple[int, ...] = _option((signal.SIGTERM,), (
        "the signals that mean \"preempted\" (``(signal.SIGTERM, signal.SIGUSR1)`` for a scheduler's warning)."))
    remote_timeout_s: float = _option(300.0, (
        "how long the final wait or close waits for uploads that keep failing (an outage) before it raises one "
        "``RemoteError`` naming the un-synced steps, which stay on disk."))
    max_unsynced_bytes: int | None = _option(None, (
        "the most bytes not yet uploaded that may pile up locally during an outage (``None``: whatever leaves 10% "
        "of ``local_dir``'s file system free)."))
    run_id: str | None = _option(None, (
        "this run's id for its lease on ``remote_url`` (``None``: the launcher's, else one kept locally)."))
    torch_loadable: bool = _option(False, "single-writer shards are also the zip archives ``torch.save`` writes.")
    replica_check: str = _option("sampled", (
        "``\"sampled\"``, ``\"full\"`` or ``\"off\"``: how ranks check the tensors they save as replicated."))
    start_over: bool = _option(False, (
        "train afresh on a ``remote_url`` that holds another run's checkpoints: they are set aside on both tiers "
        "(kept, listed by ``persist ls``, never pruned) at the first save. Without it, a run that resumed nothing "
        "there is refused at its first save (resume instead)."))
    memory: MemoryTier | None = _option(None, (
        "a :class:`MemoryTier`: snapshots in host memory that outlives the process (``maybe_save`` snapshots every "
        "``every_n_steps``; loads read the freshest source first)."))
    incremental: bool = _option(False, (
        "a save references the tensors whose bytes equal the newest committed checkpoint's (a frozen base, a PEFT "
        "model's base; proven by a 128-bit hash) instead of writing and uploading them again."))
    full_every: int = _option(10, "with ``incremental``, a full checkpoint at least every this many saves.")
    verify_resume: str = _option("warn", (
        "after a load, ``verify_resume(state)`` compares the state with what was saved: ``\"warn\"`` "
        "(a ``ResumeMismatchWarning`` naming each differing key), ``\"raise\"`` (``ResumeMismatchError``) or "
        "``\"off\"``."))
    remote_compression: str | None = _option(None, (
        "``\"zstd\"``: the remote's copy of each checksum block is compressed losslessly (floating dtypes split "
        "into byte planes first; needs ``torch-persist[compress]``); the local tier stays raw. ``None``: as on disk."))
    remote_encryption_key: SecretKey | None = _option(None, accepts=bytes | Callable[[], bytes] | None, doc=(
        "32 bytes, or a callable returning them: the remote's blocks, manifests and lease are encrypted and "
        "authenticated on this machine (AES-256-GCM; needs ``torch-persist[encrypt]``). Never logged, pickled or "
        "written; every load from that remote needs it."))
    verify_resume_ignore: tuple[str, ...] = _option((), accepts=tuple[str, ...] | list[str], doc=(
        "glob patterns of key paths (as ``persist inspect`` names them, e.g. ``optim/param_groups/*/lr``) that "
        "``verify_resume`` skips: intended changes after a resume."))
    remote_concurrency: int = _option(None, accepts=int | None, doc=(
        "requests in flight to the remote per file: upload parts and ranged reads (``None``: "
        "``PERSIST_REMOTE_CONCURRENCY`` or 8). AWS's guidance is one connection per 85-90 MB/s of the link: 16 for "
        "10 Gb/s, 36 for 25 Gb/s; parts and reads shrink so that a file gives every connection work."))

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
        if self.verify_resume not in ("warn", "raise", "off"):
            raise ConfigError(f"verify_resume={self.verify_resume!r} must be 'warn', 'raise' or 'off'")
        if isinstance(self.verify_resume_ignore, str) or not all(
                isinstance(p, str) for p in self.verify_resume_ignore):
            raise ConfigError(f"verify_resume_ignore={self.verify_resume_ignore!r} must be a sequence of glob "
                              "patterns, e.g. ['optim/param_groups/*/lr']")
        resolved("verify_resume_ignore", tuple(self.verify_resume_ignore))
        resolved("remote_concurrency", _link_knobs.check_remote_concurrency(self.remote_concurrency))
        if self.remote_url is not None:
            _knobs.check_backend(self.remote_url)
        check_compression(self.remote_compression)
        if self.remote_encryption_key is not None:
            resolved("remote_encryption_key", SecretKey(self.remote_encryption_key))
        if (self.remote_compression or self.remote_encryption_key) and self.remote_url is None:
            raise ConfigError("remote_compression / remote_encryption_key were given without remote_url; they apply to "
                              "the remote tier only: pass remote_url='s3://bucket/run' too, or drop them")
        if self.remote_encryption_key is not None:
            Codec(None, self.remote_encryption_key)  # the package is installed

    def codec(self) -> Codec:
        """What the remote tier does to the bytes it stores (:mod:`persist_core.tiers.codec`)."""
        return Codec(self.remote_compression, self.remote_encryption_key)

    @classmethod
    def from_keywords(cls, local_dir: str | os.PathLike[str], **keywords: Any) -> Config:
        """The adapters' flat keywords as a config: the retention sugar (``keep_last=3, keep_every_n_steps=1000``,
        or one ``retention`` policy) kept on both tiers (on the remote when there is one), the memory sugar
        (``memory_every_n_steps``, ``memory_dir``) as the ``memory`` option; the other keywords are options.

        Raises:
            ConfigError: a bad value (named), an unknown keyword, or ``retention`` together with a keyword.
        """
        sugar = {o.name: keywords.pop(o.name, o.default) for o in SUGAR}
        policy = policy_from_keywords(sugar["keep_last"], sugar["keep_every_n_steps"], sugar["keep_every_n_seconds"],
                                      sugar["retention"])
        memory = memory_tier(sugar["memory_every_n_steps"], sugar["memory_dir"])
        if memory is not None:
            keywords["memory"] = memory
        return cls.of(local_dir, **keywords).retaining(policy)

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


@dataclass(frozen=True)
class Option:
    """One keyword an entry point takes: the type a caller may pass, its default and its docs (written here only)."""

    name: str
    annotation: Any
    default: Any
    doc: str


def _fields() -> dict[str, Option]:
    hints = typing.get_type_hints(Config)
    return {f.name: Option(f.name, f.metadata["accepts"] or hints[f.name],
                           inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default, f.metadata["doc"])
            for f in dataclasses.fields(Config)}


#: the adapters' flat keywords, which :meth:`Config.from_keywords` turns into Config values
SUGAR = (
    Option("keep_last", int | None, None, "keep the newest N checkpoints on each tier."),
    Option("keep_every_n_steps", int | None, None,
           "keep every checkpoint whose step is a multiple of N (milestones), on each tier."),
    Option("keep_every_n_seconds", float | None, None, "keep one checkpoint per N seconds of wall time, on each tier."),
    Option("retention", RetentionPolicy | None, None,
           "one policy instead of the three keywords above (``AnyOf(KeepLastN(3), KeepEveryNSteps(1000))``), kept on "
           "both tiers. With none of them the adapter's own rule holds (the remote keeps everything)."),
    Option("memory_every_n_steps", int | None, None,
           "keep a snapshot of the state in host memory every this many optimizer steps, taken by the adapter on its "
           "own: a restart on the same machine after a crash resumes from it, losing at most that many steps, "
           "without reading the disk (several processes: each snapshots its own state, and they resume at the "
           "newest step all have)."),
    Option("memory_dir", str | os.PathLike[str] | None, None,
           "the tmpfs the snapshots live in (``None``: ``/dev/shm/torch-persist-<uid>``, one per user)."),
)

_ADAPTERS = ("remote_url", "storage_options", "keep_last", "keep_every_n_steps", "keep_every_n_seconds", "retention",
             "verify", "max_pending", "preemption_grace_s", "remote_timeout_s", "start_over", "memory_every_n_steps",
             "memory_dir", "incremental", "full_every", "verify_resume", "verify_resume_ignore",
             "remote_compression", "remote_encryption_key", "remote_concurrency")
#: which options each entry point takes as keywords, besides ``local_dir`` (its first argument) and its own
ENTRY_POINTS: dict[str, tuple[str, ...]] = {
    "CheckpointEngine": tuple(f.name for f in dataclasses.fields(Config) if f.name != "local_dir"),
    "PersistCheckpointIO": _ADAPTERS + ("write_threads",),
    "PersistHook": _ADAPTERS + ("save_policy", "preemption_signals"),
    "PersistTrainerCallback": _ADAPTERS,
}


def options_of(entry: str) -> tuple[Option, ...]:
    """The options ``entry`` (a key of :data:`ENTRY_POINTS`) takes, in its order."""
    known = {**_fields(), **{o.name: o for o in SUGAR}}
    return tuple(known[name] for name in ENTRY_POINTS[entry])


def keyword_options(entry: str) -> Callable[[T], T]:
    """A class decorator: the ``**options`` of the class's ``__init__`` shown to ``inspect.signature`` and ``help()``
    as ``entry``'s options (named, keyword-only, annotated, with their defaults), and their docs added to the class
    docstring's ``Args:`` section. The ``__init__`` itself takes ``**options`` and hands them on (checked there)."""

    def decorate(cls: T) -> T:
        init = cls.__init__  # type: ignore[misc]
        own = inspect.signature(init, eval_str=True)
        parameters = [p for p in own.parameters.values() if p.kind is not p.VAR_KEYWORD]
        parameters += [inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=o.default,
                                         annotation=o.annotation) for o in options_of(entry)]
        init.__signature__ = own.replace(parameters=parameters)
        cls.__doc__ = with_docs(cls.__doc__ or "", options_of(entry))
        return cls

    return decorate


def with_docs(doc: str, options: tuple[Option, ...], section: str = "Args:") -> str:
    """``doc`` (a Google-style docstring) with a line for each option at the end of its ``section`` (added if
    missing)."""
    lines = doc.rstrip().splitlines()
    at = next((i for i, line in enumerate(lines) if line.strip() == section), None)
    if at is None:
        lines += ["", f"    {section}"]
        at = len(lines) - 1
    indent = lines[at][:len(lines[at]) - len(lines[at].lstrip())]
    end = at + 1
    while end < len(lines) and lines[end].strip() and lines[end].startswith(indent + " "):
        end += 1
    entries = [textwrap.fill(f"{o.name}: {o.doc}", 120, initial_indent=indent + "    ",
                             subsequent_indent=indent + "        ", break_long_words=False, break_on_hyphens=False)
               for o in options]
    return "\n".join(lines[:end] + entries + lines[end:]) + "\n"


def adapter_config(entry: str, local_dir: str | os.PathLike[str], given: dict[str, Any], **fixed: Any) -> Config:
    """What an adapter's ``entry(local_dir, **given)`` configures; ``fixed``: the values the adapter sets itself.

    Raises:
        TypeError: a keyword ``entry`` does not take (as Python says it, with the closest one it takes).
        ConfigError: a bad value (named).
    """
    takes = ENTRY_POINTS[entry]
    for name in given:
        if name not in takes:
            close = difflib.get_close_matches(name, takes, n=1)
            fix = f"did you mean {close[0]}=...?" if close else f"help({entry}) lists its keywords ({', '.join(takes)}...)"
            engine = " (an option of CheckpointEngine, not of this adapter)" if name in ENTRY_POINTS["CheckpointEngine"] else ""
            raise TypeError(f"{entry}() got an unexpected keyword argument {name!r}{engine}; {fix}")
    return Config.from_keywords(local_dir, **given, **fixed)


Config.__doc__ = with_docs(Config.__doc__ or "", tuple(_fields().values()), section="Attributes:")
Config.__init__.__signature__ = inspect.Signature(  # type: ignore[attr-defined]  # the types a caller may pass
    [inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)]
    + [inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=o.default, annotation=o.annotation)
       for o in _fields().values()], return_annotation=None)
