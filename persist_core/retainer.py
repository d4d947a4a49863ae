"""One retention loop for every tier: list committed checkpoints, ask the policy, remove the rest.

Who calls what: the engine's writer thread calls :meth:`Retainer.apply` for the local tier after
each commit, the sync thread after each upload (for both tiers); ``engine.prune()`` calls it on
the training thread. One lock per tier, so two threads never prune one tier at once. Whatever the
policy says, the newest committed checkpoint and the ``protected`` steps (being written, or not
yet uploaded) stay (:func:`~persist_core.policies.retention.to_delete`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from persist_core.policies.retention import RetentionContext, RetentionPolicy, to_delete
from persist_core.tiers.tier import CheckpointInfo, Tier

log = logging.getLogger(__name__)


class Retainer:
    """Applies ``policy`` to ``tier``, never touching the steps ``protected()`` returns.

    Args:
        tier: where the checkpoints are (``list`` and ``remove`` are called).
        policy: what to keep; ``None`` keeps everything.
        protected: steps that must stay whatever the policy says, read at each pass.
    """

    def __init__(self, tier: Tier, policy: RetentionPolicy | None,
                 protected: Callable[[], set[int]] = set) -> None:
        self.tier = tier
        self.policy = policy
        self._protected = protected
        self._lock = threading.Lock()

    def apply(self) -> list[CheckpointInfo]:
        """One pass; returns what it removed.

        Raises:
            ConfigError: a custom policy answered the wrong number of times (nothing removed).
        """
        if self.policy is None:
            return []
        with self._lock:
            protected = self._protected()
            context = RetentionContext(tier=self.tier.kind, now=time.time())
            doomed = to_delete(self.tier.list(), self.policy, context=context, protected=protected)
            for info in doomed:
                log.info("[step=%d] %s retention (%r) removes %s", info.step, self.tier.kind, self.policy, info.path)
                self.tier.remove(info.step)
            return doomed
