"""Which committed checkpoint a run continues from, and what that sets going (:class:`Resumption`): the body of
``CheckpointEngine.load``, ``resume_from``, ``resumed_step`` and ``verify_resume``.

Who calls what (training thread): the engine's ``load`` calls :meth:`Resumption.load` (several ranks agree on one
step); every load the engine's reader returns (the engine's, or an adapter's through ``engine.reader``) calls
:meth:`Resumption.loaded` with its manifest; ``resume_from`` calls :meth:`Resumption.resume_from` (a step loaded
elsewhere). Each resume tells, in this order: the lineage (resumed from, branch), the history (an interval policy
counts from it), the timeline (the next save or snapshot past it decides, once, whether the resume branches), and,
from the remote, the sync side (this run takes over the remote's lease) and the next incremental save (full unless
what it references is local); a load also warms the staging buffers for saves about as large (:meth:`Saver.warm`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from persist_core import _knobs
from persist_core.distributed import Collectives, decision_channel
from persist_core.format.manifest import Manifest
from persist_core.history import SaveHistory
from persist_core.lineage import Lineage
from persist_core.load.agree import Partner, agreed_load
from persist_core.load.reader import CheckpointReader
from persist_core.load.verify import verify_resume
from persist_core.pipeline import Pipeline
from persist_core.save.saver import Saver
from persist_core.tiers.local import committed_steps


class Resumption:
    """One engine's resume point.

    Args:
        root: ``local_dir`` (its committed steps say whether a resume branches).
        reader: the engine's reader (what it loaded last).
        coll: the collectives (several ranks load one agreed step).
        lineage: recorded in every manifest a save writes.
        history / pipeline / saver: told of each resume (see the module's docstring).
        partner: how a restore pulls a partner's copy back (several nodes), or ``None``.
        verify_mode / ignore: ``Config.verify_resume`` and ``Config.verify_resume_ignore``.
    """

    def __init__(self, root: Path, *, reader: CheckpointReader, coll: Collectives, lineage: Lineage,
                 history: SaveHistory, pipeline: Pipeline, saver: Saver, partner: Partner | None,
                 verify_mode: str, ignore: Sequence[str]) -> None:
        self._root, self._reader, self._coll, self.lineage = root, reader, coll, lineage
        self._history, self._pipeline, self._saver, self._partner = history, pipeline, saver, partner
        self._verify_mode, self._ignore = verify_mode, tuple(ignore)
        self._resumed: int | None = None
        self._manifest: Manifest | None = None  # the checkpoint verify_resume compares with
        self._closed = False

    @property
    def step(self) -> int | None:
        """``CheckpointEngine.resumed_step``: the step given to :meth:`resume_from`, else the one loaded last."""
        return self._resumed if self._resumed is not None else self._reader.loaded_step

    def load(self, step: int | None, **kwargs: Any) -> Any:
        """``CheckpointEngine.load``: with several ranks and no ``step``, the newest step every rank can get
        (:func:`~persist_core.load.agree.agreed_load`, a collective call); from the remote, this run continues the
        one that wrote it (its lease)."""
        chan = decision_channel(self._coll)
        if step is None and chan is not None and chan.world_size > 1:
            state = agreed_load(self._reader, chan, self._partner, **kwargs)
        else:
            state = self._reader.load(step, **kwargs)
        if self._reader.loaded_from_remote:  # a fresh machine: this run continues the one that wrote it
            self._pipeline.adopt_remote_run()
        return state

    def resume_from(self, step: int, *, from_remote: bool, loaded: Manifest | None) -> None:
        """``CheckpointEngine.resume_from``: ``step`` checked committed on a tier (``ConfigError`` naming those that
        are); ``loaded``: its manifest, what :meth:`verify` compares with."""
        self.continue_from(_knobs.check_resume_step(step, self._reader), from_remote=from_remote)
        if loaded is not None:
            self._manifest = loaded

    def continue_from(self, step: int, *, from_remote: bool = False) -> None:
        """:meth:`resume_from` without the check that ``step`` is committed here: a session's weights-only engine
        continues from the step its full engine resumed from."""
        self._resumed = step
        self._resumed_at(step, run=None)
        if from_remote:
            self._pipeline.adopt_remote_run()

    def loaded(self, manifest: Manifest) -> None:
        """The reader's ``on_loaded``: a load returned ``manifest``'s checkpoint; this process continues from it, and
        the staging buffers for saves about as large are made ready in the background (unless closed)."""
        self._manifest = manifest
        self._resumed_at(manifest.step, run=(manifest.lineage or {}).get("run"))
        incremental = self._pipeline.incremental
        if incremental is not None and self._reader.loaded_from_remote:
            incremental.loaded_from_remote(manifest.step)  # the next save: full unless what it references is local
        if not self._closed:
            self._saver.warm(manifest)

    def _resumed_at(self, step: int, *, run: str | None) -> None:
        self.lineage.resumed(step, run=run, branch=any(s > step for s in committed_steps(self._root)))
        self._history.resumed()  # an interval policy counts from this checkpoint
        self._pipeline.timeline.resumed()  # the next step past it decides, once, whether this resume branches

    def verify(self, state: Any, *, ignore: Sequence[str], new_ok: Sequence[str], partial: bool) -> list[str]:
        """``CheckpointEngine.verify_resume``: ``state`` against the checkpoint loaded last
        (:func:`~persist_core.load.verify.verify_resume`)."""
        return verify_resume(self._manifest, state, mode=self._verify_mode, rank=self._coll.rank,
                             world_size=self._coll.world_size, ignore=(*self._ignore, *ignore), new_ok=new_ok,
                             partial=partial)

    def close(self) -> None:
        """The engine closed: a later load (through its reader) warms no buffers."""
        self._closed = True
