"""Where committed checkpoints live: the ``Tier`` protocols (read side, full), the local directory, a remote URL."""

from persist_core.tiers.local import LocalTier
from persist_core.tiers.remote import RemoteTier
from persist_core.tiers.tier import CheckpointInfo, Tier, TierReader

__all__ = ["CheckpointInfo", "LocalTier", "RemoteTier", "Tier", "TierReader"]
