"""The un-synced record: ``local_dir/.unsynced.json``, the steps committed there and not yet uploaded.

The engine rewrites it (:class:`UnsyncedRecord`, best effort) whenever that set may have changed: after
each commit and each upload on rank 0, after each upload round on another node's leader. ``persist gc``
and ``persist rm`` read it (:func:`read_unsynced`) and never remove those steps; an unreadable record
means nobody knows, so every checkpoint there is kept.

It also says up to which step it knows (``through``: the newest step committed when it was written): the next
engine's start-up backlog (:func:`read_backlog`) is what it names, and what was committed after it, and nothing
else — a checkpoint uploaded once and then removed from the remote by its retention is not uploaded again.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from persist_core.errors import ConfigError
from persist_core.layout import MAX_STEP, UNSYNCED_NAME
from persist_core.sidefiles import read_side_file, warn_once, write_side_file

log = logging.getLogger(__name__)


class UnsyncedRecord:
    """Rewrites ``root``'s record of the steps ``steps()`` says are not uploaded to ``remote`` yet.

    Any thread calls :meth:`write` (the writer thread after a commit, the sync thread after an upload, a
    follower thread after an upload round); one lock keeps the rewrites whole and in order.
    """

    def __init__(self, root: Path, remote: str, steps: Callable[[], set[int]],
                 newest: Callable[[], int | None] = lambda: None) -> None:
        self._root = root
        self._remote = remote
        self._steps = steps
        self._newest = newest  # the newest committed step: read before steps() (a step being committed is in it)
        self._lock = threading.Lock()

    def write(self) -> None:
        """Rewrite the record (best effort: a failure is logged, never raised)."""
        with self._lock:
            try:
                through = self._newest()
                write_unsynced(self._root, self._remote, self._steps(), through=through)
            except ConfigError as e:  # a link where the record goes: never written through (said once)
                warn_once(log, str(self._root / UNSYNCED_NAME), "could not record the un-synced steps in %s: %s",
                          self._root, e)
            except OSError as e:
                log.warning("could not record the un-synced steps in %s: %s", self._root, e)


def write_unsynced(root: Path, remote: str, steps: set[int], *, through: int | None = None) -> None:
    """Record (atomically) that ``steps`` are committed in ``root`` and not yet uploaded to ``remote``, and every
    other step up to ``through`` is (or never will be: superseded).

    Raises:
        ConfigError: a link is where its temporary goes (named). OSError: the write failed.
    """
    body = json.dumps({"remote": remote, "steps": sorted(steps), "updated": time.time(), "through": through})
    write_side_file(root / UNSYNCED_NAME, body.encode())  # only the holder of rank 0's writer lock writes it


def read_unsynced(root: Path) -> tuple[str | None, set[int] | None]:
    """``(remote, steps)`` of the un-synced record in ``root``: ``(None, set())`` when there is none,
    ``steps=None`` when it is unreadable (then nobody knows: keep every checkpoint)."""
    path = root / UNSYNCED_NAME
    try:
        data = json.loads(read_side_file(path))
        remote, steps = data["remote"], data["steps"]
        if not isinstance(remote, str) or not isinstance(steps, list) or not all(
                type(s) is int and 0 <= s <= MAX_STEP for s in steps):
            raise ValueError("not a remote URL and a list of steps")
        return remote, set(steps)
    except FileNotFoundError:
        return None, set()
    except (ValueError, KeyError, TypeError) as e:  # ConfigError (a link) and UnicodeDecodeError are ValueErrors
        log.warning("%s is unreadable (%s); every checkpoint there counts as not uploaded", path, e)
        return None, None


def read_backlog(root: Path, remote: str) -> tuple[set[int], int] | None:
    """``(steps not uploaded, through)`` of ``root``'s record for ``remote``: a start-up uploads those steps and the
    ones newer than ``through``. ``None`` when the record cannot say (none, another remote's, unreadable, or written
    before it recorded ``through``): then every local checkpoint the remote lacks is uploaded."""
    recorded, steps = read_unsynced(root)
    if recorded != remote or steps is None:
        return None
    try:
        through = json.loads(read_side_file(root / UNSYNCED_NAME)).get("through")
    except (OSError, ValueError):
        return None
    if type(through) is not int or not 0 <= through <= MAX_STEP:
        return None
    return steps, through
