"""Lightning paths as links: which path names which step, on disk and intended.

``ModelCheckpoint`` decides paths (``epoch=0-step=50.ckpt``, ``last.ckpt``); each becomes a
relative symbolic link to the committed ``local_dir/step-N`` directory, created (or atomically
replaced with one ``rename``) once the checkpoint is committed. :class:`Links` records, per path,
the step it was last saved at (maybe still pending) and the step its link names now; retention
keeps both (:class:`KeepLinked`). Who calls what: the plugin's ``save_checkpoint`` calls
:meth:`Links.intend`, the writer thread :meth:`Links.on_committed`, ``remove_checkpoint``
:meth:`Links.remove`.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from persist_core import CheckpointInfo, PersistError, RetentionContext
from persist_core.fileio import fsync_dir
from persist_core.layout import checkpoint_dirname, parse_checkpoint_dirname

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KeepLinked:
    """Keeps the steps that a live Lightning path names (``linked()`` is read at each decision)."""

    linked: Callable[[], set[int]]

    def should_keep(self, checkpoints: Sequence[CheckpointInfo], *, context: RetentionContext) -> Sequence[bool]:
        live = self.linked()
        return [c.step in live for c in checkpoints]

    def __repr__(self) -> str:
        return "KeepLinkedByLightning()"


class Links:
    """Path -> step, for the paths under one ``local_dir``'s checkpoints."""

    def __init__(self, local_dir: Path) -> None:
        self._local_dir = local_dir
        self._lock = threading.Lock()
        self._intended: dict[str, int] = {}
        self._on_disk: dict[str, int] = {}
        self._scanned: set[str] = set()
        self._errors: list[BaseException] = []

    def steps(self) -> set[int]:
        with self._lock:
            return set(self._intended.values()) | set(self._on_disk.values())

    def intended(self, target: str) -> int | None:
        with self._lock:
            return self._intended.get(target)

    def adopt(self, directory: str) -> None:
        """Record the links an earlier run left in ``directory``, so their checkpoints stay."""
        if directory in self._scanned:
            return
        self._scanned.add(directory)
        try:
            entries = list(os.scandir(directory))
        except FileNotFoundError:
            return
        root = Path(os.path.realpath(self._local_dir))
        for entry in entries:
            if not entry.is_symlink():
                continue
            real = Path(os.path.realpath(entry.path))
            step = parse_checkpoint_dirname(real.name) if real.parent == root else None
            if step is not None and real.is_dir():
                with self._lock:
                    self._on_disk.setdefault(entry.path, step)

    def intend(self, target: str, step: int) -> None:
        with self._lock:
            self._intended[target] = step

    def on_committed(self, target: str, step: int, committed: bool) -> None:
        """Writer thread: link ``target`` to the committed directory, unless it was removed meanwhile."""
        with self._lock:
            if self._intended.get(target) != step:
                return
            if not committed:
                del self._intended[target]
                return
            try:
                link(target, self._local_dir / checkpoint_dirname(step))
                self._on_disk[target] = step
            except OSError as e:
                error = PersistError(f"checkpoint step={step} is committed, but linking {target!r} to it failed: {e}")
                log.error("%s", error)
                self._errors.append(error)

    def remove(self, target: str) -> None:
        """Forget ``target`` and delete the link (or a plain file another IO left) there."""
        with self._lock:
            self._intended.pop(target, None)
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


def link(target: str, ckpt_dir: Path) -> None:
    """Point ``target`` at ``ckpt_dir`` with one atomic rename of a fresh relative link."""
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(target)}.link-{secrets.token_hex(3)}")
    os.symlink(os.path.relpath(ckpt_dir, parent), tmp)
    try:
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise
    fsync_dir(Path(parent))
