"""The memory tier's option (:class:`MemoryTier`, what a user configures: ``CheckpointEngine(local_dir,
memory=MemoryTier(every_n_steps=1))``; the adapters' ``memory_every_n_steps``/``memory_dir`` made into one,
:func:`memory_tier`), and what it opens: a rank's store, a partner's, the reads of a run's snapshots."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from persist_core._knobs import memory_type_error
from persist_core.errors import ConfigError
from persist_core.layout import DEFAULT_MEMORY_DIR, layout_identity, memory_rank_dirname, partner_dirname
from persist_core.memory.files import default_base
from persist_core.memory.read import run_store
from persist_core.memory.store import MemoryStore


@dataclass(frozen=True)
class MemoryTier:
    """Snapshots in host memory that outlives the process: a restart on the same machine after a crash resumes
    from the last snapshot (at most ``every_n_steps`` steps lost) without reading the disk.

    ``engine.maybe_save(make_state, step)`` snapshots every ``every_n_steps`` steps; the engine's ``save_policy``
    picks which steps also go to disk (without one, disk saves happen on an explicit ``save()`` only). Each
    snapshot costs one copy of the state into shared memory (the staging copy a disk save makes anyway).

    Args:
        every_n_steps: snapshot every this many steps (1: every step).
        memory_dir: a tmpfs to keep the snapshots in (default ``/dev/shm/torch-persist-<uid>``, one per user); it
            needs room for
            ``max_pending + 2`` copies of each rank's state, and with several nodes two more of each partner's (the
            copies this node holds for the previous node's ranks). Where it has less, the engine warns once and
            saves to disk only (partner copies: dropped, said once).

    Several ranks: each snapshots its whole state; ``engine.load()`` agrees on the newest step every rank has whole.
    Several nodes: each rank's newest snapshot is also copied to its partner (the same local rank on the next
    node), so a lost node restores from the other node's memory (:mod:`persist_core.memory.partner`).
    """

    every_n_steps: int = 1
    memory_dir: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        n = self.every_n_steps
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"MemoryTier(every_n_steps={n!r}) must be a positive int (1: a snapshot every step)")
        if self.memory_dir is not None and not isinstance(self.memory_dir, (str, os.PathLike)):
            raise ConfigError(f"MemoryTier(memory_dir={self.memory_dir!r}) must be a path to a tmpfs directory "
                              f"(default {DEFAULT_MEMORY_DIR}) or None")

    @property
    def base(self) -> Path:
        """Where every run's snapshots live."""
        if self.memory_dir is None:
            return default_base()
        return Path(os.fspath(self.memory_dir)).expanduser().absolute()

    def due(self, step: int) -> bool:
        """Whether ``step`` is a snapshot step."""
        return step % self.every_n_steps == 0

    def store(self, run_id: str, rank: int, local_dir: Path, identity: str) -> MemoryStore:
        """Rank ``rank``'s snapshots of run ``run_id`` made for ``local_dir`` (its :func:`local_dir_identity`)."""
        return MemoryStore(self.base / run_id / memory_rank_dirname(rank), identity=identity, local_dir=local_dir,
                           check_base=self.memory_dir is None)

    def reads(self, local_dir: Path) -> MemoryStore | None:
        """The snapshots of the run ``local_dir`` keeps the id of, as a load reads them (a
        :class:`~persist_core.tiers.tier.HostReader`; ``None``: none, said why)."""
        root = Path(local_dir)
        return run_store(lambda run_id, identity: self.store(run_id, 0, root, identity), root)

    def partner_store(self, run_id: str, of_rank: int, *, layout: tuple[tuple[int, ...], ...]) -> MemoryStore:
        """The copies of rank ``of_rank``'s snapshots that this node holds as its partner: the run's (its id and
        node ``layout``), whatever this node's ``local_dir`` (a replaced node's is new)."""
        return MemoryStore(self.base / run_id / partner_dirname(of_rank), identity=layout_identity(layout),
                           check_base=self.memory_dir is None)


def check_memory(value: Any) -> MemoryTier | None:
    """``value`` as the ``memory`` option, or a ConfigError naming it."""
    if value is None or isinstance(value, MemoryTier):
        return value
    raise memory_type_error(value)


def memory_tier(every_n_steps: int | None, memory_dir: str | os.PathLike[str] | None) -> MemoryTier | None:
    """The adapters' two keywords (``memory_every_n_steps``, ``memory_dir``) as the ``memory`` option."""
    if every_n_steps is None:
        if memory_dir is not None:
            raise ConfigError(f"memory_dir={os.fspath(memory_dir)!r} was given without memory_every_n_steps; pass "
                              "memory_every_n_steps=1 (a snapshot in memory every step) or drop memory_dir")
        return None
    if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1:
        raise ConfigError(f"memory_every_n_steps={every_n_steps!r} must be a positive int (1: a snapshot every step)")
    return MemoryTier(every_n_steps=every_n_steps, memory_dir=memory_dir)
