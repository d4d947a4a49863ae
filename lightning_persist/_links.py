"""Lightning paths as links: which path names which step, on disk and intended.

``ModelCheckpoint`` decides paths (``epoch=0-step=50.ckpt``, ``last.ckpt``); each becomes a
relative symbolic link to the committed ``local_dir/step-N`` directory, created (or atomically
replaced with one ``rename``) once the checkpoint is committed. :class:`Links` records, per path,
the step it was last saved at (maybe still pending) and the step its link names now; retention
keeps both (:func:`keep_linked`). Who calls what: the plugin's ``save_checkpoint`` calls
:meth:`Links.intend`, the writer thread :meth:`Links.on_committed`, ``remove_checkpoint``
:meth:`Links.remove`.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from pathlib import Path

from persist_core import PersistError
from persist_core.fileio import link_atomically as link
from persist_core.layout import FULL, KINDS, checkpoint_dirname, kind_subdir, parse_checkpoint_dirname
from persist_core.policies.retention import KeepStepsOf
from persist_core.load.reader import checkpoint_of

log = logging.getLogger(__name__)

Key = tuple[str, int]  # (kind, step): one checkpoint


def keep_linked(links: Links, kind: str) -> KeepStepsOf:
    """The retention that keeps the steps of ``kind`` a live Lightning path names (read at each decision)."""
    return KeepStepsOf(functools.partial(links.steps, kind), "KeepLinked")


class Links:
    """Path -> step, for the paths under one ``local_dir``'s checkpoints.

    A path may have several saves requested and not yet committed (``last.ckpt`` at each step while
    commits lag behind). Each commit links the path if it is the newest *request* committed so far
    for it, so the path names the newest committed checkpoint requested for it — the older one
    until the newer commits — and never goes missing while saves overtake commits.
    """

    def __init__(self, local_dir: Path, *, file_name: str | None = None) -> None:
        self._local_dir = local_dir
        self._file_name = file_name  # link to this file of a checkpoint when it has it (a torch-loadable shard)
        self._lock = threading.Lock()
        self._requests: dict[str, dict[Key, int]] = {}  # path -> {(kind, step): request number}, not committed yet
        self._on_disk: dict[str, tuple[Key, int]] = {}  # path -> ((kind, step), request number) its link names
        self._count = 0
        self._scanned: set[str] = set()
        self._errors: list[BaseException] = []

    def steps(self, kind: str = FULL) -> set[int]:
        """The steps of ``kind`` some path names or will name."""
        with self._lock:
            keys = {key for keys in self._requests.values() for key in keys}
            keys |= {key for key, _ in self._on_disk.values()}
            return {step for k, step in keys if k == kind}

    def intended(self, target: str) -> Key | None:
        """``(kind, step)`` of the newest save requested for ``target`` (pending or linked), or ``None``."""
        with self._lock:
            best = max(((n, key) for key, n in self._requests.get(target, {}).items()), default=None)
            linked = self._on_disk.get(target)
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
            try:
                os.unlink(path)
            except FileNotFoundError:
                return
        log.info("removed %s: the checkpoint of step %d it named is no longer in %s", path, step, self._local_dir)

    def intend(self, target: str, step: int, kind: str = FULL) -> None:
        with self._lock:
            self._count += 1
            self._requests.setdefault(target, {})[kind, step] = self._count

    def on_committed(self, target: str, step: int, committed: bool, kind: str = FULL) -> None:
        """Writer thread: link ``target`` to the committed directory if this is its newest committed request."""
        with self._lock:
            number = self._requests.get(target, {}).pop((kind, step), None)
            if not self._requests.get(target, True):
                del self._requests[target]
            if number is None or not committed:  # removed meanwhile, or not committed
                return
            if self._on_disk.get(target, (-1, -1))[1] > number:  # a newer request is linked already
                return
            try:
                ckpt = self._local_dir / kind_subdir(kind) / checkpoint_dirname(step)
                single = None if self._file_name is None else ckpt / self._file_name
                link(target, single if single is not None and single.is_file() else ckpt)
                self._on_disk[target] = ((kind, step), number)
            except OSError as e:
                error = PersistError(f"checkpoint step={step} is committed, but linking {target!r} to it failed: {e}")
                log.error("%s", error)
                self._errors.append(error)

    def remove(self, target: str) -> None:
        """Forget ``target`` and delete the link (or a plain file another IO left) there."""
        with self._lock:
            self._requests.pop(target, None)
            self._on_disk.pop(target, None)
            if os.path.islink(target):
                os.unlink(target)
            elif os.path.isfile(target):
                os.remove(target)

    def raise_errors(self) -> None:
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]
