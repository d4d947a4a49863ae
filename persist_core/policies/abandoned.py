"""Set-aside branches are kept, never silently (:class:`AbandonedWatch`): one warning when they outgrow the live
branch.

Who calls what: the writer thread, after local retention following each commit
(:class:`~persist_core.pipeline.Pipeline`), where this rank applies local retention; nothing else.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from persist_core.tiers.tier import CheckpointInfo

log = logging.getLogger(__name__)


class Branches(Protocol):
    """What the watch reads of a tier (:class:`~persist_core.tiers.local.LocalTier`)."""

    def list(self) -> list[CheckpointInfo]: ...

    def abandoned(self) -> list[CheckpointInfo]: ...


class AbandonedWatch:
    """Warns once when the set-aside (abandoned) checkpoints of ``tier`` hold more bytes than its live branch.

    A resume from an older step sets the newer checkpoints aside (kept, never pruned by retention): without a word,
    each such branch would fill the disk. The warning names both sizes and the command that removes them
    (``persist gc --abandoned``); after it, :meth:`check` reads nothing more.

    Args:
        tier: the local tier.
        where: the directory, for the message.
    """

    def __init__(self, tier: Branches, where: str) -> None:
        self._tier = tier
        self._where = where
        self.warned = False

    def check(self) -> None:
        """One look (after a commit's local retention): warn if the abandoned bytes exceed the live ones."""
        if self.warned:
            return
        aside = self._tier.abandoned()
        if not aside:
            return
        live = self._tier.list()
        aside_bytes, live_bytes = _bytes(aside), _bytes(live)
        if aside_bytes <= live_bytes:
            return
        self.warned = True
        log.warning("%d abandoned checkpoints in %s (set aside by resumes from older steps, kept) hold %d bytes "
                    "(%.2f GB), more than the %d live ones (%d bytes, %.2f GB): `persist gc --abandoned %s` removes "
                    "them (and on the remote: `persist gc --abandoned <remote_url>`); `persist ls` lists them",
                    len(aside), self._where, aside_bytes, aside_bytes / 1e9, len(live), live_bytes, live_bytes / 1e9,
                    self._where)


def _bytes(infos: Sequence[CheckpointInfo]) -> int:
    return sum(i.nbytes for i in infos)
