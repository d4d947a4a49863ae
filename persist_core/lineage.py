"""Where a checkpoint comes from (issue 55): the lineage every manifest a save writes carries (format version 7).

Who calls what: the engine makes one :class:`Lineage` (the versions read and the git commit looked up once, when it
is made, the commit on a thread of its own: nothing of it on a save's path), tells it
what it loaded or resumed from (:meth:`Lineage.resumed`), and the saver records :meth:`Lineage.record` in each
manifest. Nothing here fails a save: what cannot be found out is ``None``.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from persist_core.errors import ConfigError
from persist_core.run_ids import run_id_of

log = logging.getLogger(__name__)

#: the packages whose versions a manifest records when this process imported them (torch and torch-persist always)
FRAMEWORKS = ("lightning", "pytorch_lightning", "accelerate", "transformers")


def package_versions() -> dict[str, str]:
    """torch's and torch-persist's versions, and each of :data:`FRAMEWORKS` already imported (``sys.modules``)."""
    import torch

    out = {"torch": str(torch.__version__), "torch-persist": _own_version()}
    for name in FRAMEWORKS:
        module = sys.modules.get(name)
        version = getattr(module, "__version__", None) if module is not None else None
        if version is not None:
            out[name] = str(version)
    return out


def _own_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch-persist")
    except PackageNotFoundError:
        return "unknown"


def git_commit() -> str | None:
    """``git rev-parse HEAD`` in the current directory (the training code's checkout), or ``None`` (no checkout, no
    git, anything else): best effort, never raising."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = done.stdout.strip()
    return commit if done.returncode == 0 and len(commit) in (40, 64) else None


class Lineage:
    """One engine's lineage: its run, what it resumed from, and what it runs on.

    Args:
        run_id: this run's id (``None``: none kept).
        world_size: how many ranks save.
    """

    def __init__(self, *, run_id: str | None, world_size: int) -> None:
        self._run_id = run_id
        self._world_size = world_size
        self._lock = threading.Lock()
        self._versions = package_versions()  # once: never on a save's path
        self._commit: list[str | None] = []  # looked up once, in the background (a subprocess: never on a save's path)
        threading.Thread(target=lambda: self._commit.append(git_commit()), name="persist-lineage", daemon=True).start()
        self._resumed: dict[str, Any] | None = None
        self._branch: int | None = None

    @classmethod
    def of(cls, root: Path, given: str | None, *, world_size: int) -> Lineage:
        """The lineage of an engine on ``root``: its run id the one given, the launcher's, or the one kept in ``root``
        (``None`` when there is none: never made here, nor an error)."""
        try:
            run_id = run_id_of(root, given, create=False)
        except ConfigError:
            run_id = None
        return cls(run_id=run_id, world_size=world_size)

    def resumed(self, step: int, *, run: str | None, branch: bool) -> None:
        """This run continues from committed ``step`` of ``run``; ``branch``: newer checkpoints were committed (the run
        went back to ``step``)."""
        with self._lock:
            self._resumed = {"step": step, "run": run}
            self._branch = step if branch else None

    def record(self) -> dict[str, Any]:
        """The lineage a manifest written now records."""
        with self._lock:  # the commit: None until its lookup ended (a save right after the engine was made)
            return {"run": self._run_id, "resumed_from": None if self._resumed is None else dict(self._resumed),
                    "branch_from": self._branch, "world_size": self._world_size, "versions": dict(self._versions),
                    "git_commit": self._commit[0] if self._commit else None}
