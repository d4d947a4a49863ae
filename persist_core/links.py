"""Named links: a name the user (or the framework) chose -> an atomic link to a committed step, kept by retention.

A framework adapter lets users name their checkpoints: Lightning's ``ModelCheckpoint`` decides paths
(``epoch=0-step=50.ckpt``, ``last.ckpt``), Accelerate's ``save_state(output_dir)`` names a directory (or
its automatic naming picks ``checkpoints/checkpoint_<i>``). The engine writes every checkpoint to
``local_dir/step-N`` (``local_dir/<kind>/step-N`` for other kinds); each name becomes a relative symbolic
link to that directory (or to its torch-loadable shard file, with ``file_name``), created or atomically
replaced with one ``rename`` once the checkpoint is committed. :class:`Links` records, per name, the
steps saved for it (maybe still pending) and the step its link names now; retention keeps both
(:meth:`Links.keep`), except for automatic names, which retention limits as the framework would.

Who calls what: the training thread calls :meth:`Links.intend` (through
:meth:`~persist_core.session.PersistSession.link`), :meth:`Links.remove`, :meth:`Links.adopt`,
:meth:`Links.sweep` and :meth:`Links.raise_errors`; the writer thread :meth:`Links.on_committed`; the
retention decision (writer or sync thread) :meth:`Links.steps`.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from pathlib import Path

from persist_core.errors import PersistError
from persist_core.fileio import link_atomically as link
from persist_core.layout import FULL, KINDS, checkpoint_dirname, kind_subdir, parse_checkpoint_dirname
from persist_core.policies.retention import KeepStepsOf
from persist_core.load.paths import checkpoint_of

log = logging.getLogger(__name__)

Key = tuple[str, int]  # (kind, step): one checkpoint


class Links:
    """Name -> step, for the names linking to one ``local_dir``'s checkpoints.

    A name may have several saves requested and not yet committed (``last.ckpt`` at each step while
    commits lag behind). Each commit links the name if it is the newest *request* committed so far
    for it, so the name links to the newest committed checkpoint requested for it — the older one
    until the newer commits — and never goes missing while saves overtake commits.

    Args:
        local_dir: the engine's local tier.
        file_name: link to this file of a checkpoint when it has it (a torch-loadable shard), else to
            the directory.
        retain_only_linked: with no retention policy, keep only what a name links to (Lightning:
            ``ModelCheckpoint`` decides which paths exist); without it, the links keep their steps
            besides the user's policy, and with no policy everything stays (Accelerate).
    """

    def __init__(self, local_dir: Path, *, file_name: str | None = None, retain_only_linked: bool = False) -> None:
        self._local_dir = local_dir
        self._file_name = file_name
        self.retain_only_linked = retain_only_linked
        self._lock = threading.Lock()  # the writer thread links, the training thread names
        self._requests: dict[str, dict[Key, int]] = {}  # name -> {(kind, step): request number}, not committed yet
        self._on_disk: dict[str, tuple[Key, int]] = {}  # name -> ((kind, step), request number) its link names
        self._automatic: set[str] = set()  # names the framework numbered: not kept, dead ones swept
        self._count = 0
        self._scanned: set[str] = set()
        self._errors: list[BaseException] = []

    def keep(self, kind: str = FULL) -> KeepStepsOf:
        """The retention that keeps the steps of ``kind`` a live name links to (read at each decision)."""
        return KeepStepsOf(functools.partial(self.steps, kind), "KeepLinked")

    def steps(self, kind: str = FULL) -> set[int]:
        """The steps of ``kind`` a name (not an automatic one) will link to, or still links to."""
        with self._lock:
            keys = {key for name, keys in self._requests.items() if name not in self._automatic for key in keys}
            linked = [(name, key) for name, (key, _) in self._on_disk.items() if name not in self._automatic]
        keys |= {key for name, key in linked if os.path.lexists(name)}
        return {step for k, step in keys if k == kind}

    def intended(self, name: str) -> Key | None:
        """``(kind, step)`` of the newest save requested for ``name`` (pending or linked), or ``None``."""
        with self._lock:
            best = max(((n, key) for key, n in self._requests.get(name, {}).items()), default=None)
            linked = self._on_disk.get(name)
            if linked is not None and (best is None or linked[1] > best[0]):
                return linked[0]
            return None if best is None else best[1]

    def adopt(self, directory: str) -> None:
        """Record the links an earlier run left in ``directory``, so their checkpoints stay."""
        if directory in self._scanned:
            return
        self._scanned.add(directory)
        try:
            entries = list(os.scandir(directory))
        except FileNotFoundError:
            return
        for entry in entries:
            named = self.checkpoint_named(entry.path) if entry.is_symlink() else None
            if named is None:
                continue
            key, real = named
            if real.is_dir():
                with self._lock:
                    self._on_disk.setdefault(entry.path, (key, -1))
            else:
                self._unlink_dead(entry.path, key[1])

    def sweep(self) -> None:
        """Remove the links that name a checkpoint no longer there (set aside by a branch, removed by
        ``persist gc``): provably dead, they would load nothing. Links to live checkpoints stay."""
        with self._lock:
            known = dict(self._on_disk)
        for path, (key, _) in known.items():
            named = self.checkpoint_named(path) if os.path.islink(path) else None
            if named is not None and named[0] == key and not named[1].is_dir():
                self._unlink_dead(path, key[1])

    def checkpoint_named(self, path: str) -> tuple[Key, Path] | None:
        """``((kind, step), its directory)`` when ``path`` (through links) names a checkpoint directory of
        ``local_dir`` or its shard file, whether that directory still exists or not; else ``None``."""
        real = checkpoint_of(Path(os.path.realpath(path)))
        for kind in KINDS:
            if real.parent == Path(os.path.realpath(self._local_dir / kind_subdir(kind))):
                step = parse_checkpoint_dirname(real.name)
                return None if step is None else ((kind, step), real)
        return None

    def _unlink_dead(self, path: str, step: int) -> None:
        with self._lock:
            if self._requests.get(path):  # a save of this run will link it
                return
            self._on_disk.pop(path, None)
            self._automatic.discard(path)
            try:
                os.unlink(path)
            except FileNotFoundError:
                return
        log.info("removed %s: the checkpoint of step %d it named is no longer in %s", path, step, self._local_dir)

    def intend(self, name: str, step: int, kind: str = FULL, *, automatic: bool = False) -> None:
        """``name`` will link to ``(kind, step)`` once it is committed; retention keeps that step from now on.

        ``automatic``: a name the framework numbered (Accelerate's ``checkpoint_<i>``): retention does not keep
        its step, and once it links, the links beside it whose checkpoint retention removed go, as the
        framework deletes its oldest (``total_limit``)."""
        with self._lock:
            self._count += 1
            self._requests.setdefault(name, {})[kind, step] = self._count
            if automatic:
                self._automatic.add(name)
            else:
                self._automatic.discard(name)

    def on_committed(self, name: str, step: int, committed: bool, kind: str = FULL) -> None:
        """Writer thread: link ``name`` to the committed directory if this is its newest committed request."""
        with self._lock:
            number = self._requests.get(name, {}).pop((kind, step), None)
            if not self._requests.get(name, True):
                del self._requests[name]
            if number is None or not committed:  # removed meanwhile, or not committed
                return
            if self._on_disk.get(name, (-1, -1))[1] > number:  # a newer request is linked already
                return
            try:
                ckpt = self._local_dir / kind_subdir(kind) / checkpoint_dirname(step)
                single = None if self._file_name is None else ckpt / self._file_name
                link(name, single if single is not None and single.is_file() else ckpt)
                self._on_disk[name] = ((kind, step), number)
            except OSError as e:
                error = PersistError(f"checkpoint step={step} is committed, but linking {name!r} to it failed: {e}")
                log.error("%s", error)
                self._errors.append(error)
                return
            automatic = name in self._automatic
        if automatic:
            self._sweep_beside(name)

    def _sweep_beside(self, name: str) -> None:
        """The links beside an automatic ``name`` whose checkpoint is gone (retention removed it)."""
        try:
            entries = list(os.scandir(os.path.dirname(name)))
        except OSError as e:
            log.error("could not list %s for links to removed checkpoints: %s", os.path.dirname(name), e)
            return
        for entry in entries:
            named = self.checkpoint_named(entry.path) if entry.is_symlink() else None
            if named is not None and not named[1].is_dir():
                try:
                    self._unlink_dead(entry.path, named[0][1])
                except OSError as e:  # the writer thread's callback must not raise
                    log.error("could not remove %s (its checkpoint is gone): %s", entry.path, e)

    def remove(self, name: str) -> None:
        """Forget ``name`` and delete the link (or a plain file another IO left) there."""
        with self._lock:
            self._requests.pop(name, None)
            self._on_disk.pop(name, None)
            self._automatic.discard(name)
            if os.path.islink(name):
                os.unlink(name)
            elif os.path.isfile(name):
                os.remove(name)

    def raise_errors(self) -> None:
        """Raise the first link that failed since the last call (each is logged when it fails), once."""
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]
