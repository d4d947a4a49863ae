"""Where committed checkpoints live: the ``Tier`` protocol, the local directory, a remote URL."""

from persist_core.tiers.local import LocalTier
from persist_core.tiers.remote import RemoteTier
from persist_core.tiers.tier import CheckpointInfo, Tier

__all__ = ["CheckpointInfo", "LocalTier", "RemoteTier", "Tier"]
