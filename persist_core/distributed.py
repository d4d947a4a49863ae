"""Rank information, detected once at the edge and passed in as plain data."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the job."""

    rank: int = 0
    world_size: int = 1

    @classmethod
    def detect(cls) -> RankInfo:
        """From an initialized ``torch.distributed`` group, else ``RANK``/``WORLD_SIZE``, else single."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return cls(rank=dist.get_rank(), world_size=dist.get_world_size())
        return cls(rank=int(os.environ.get("RANK", 0)), world_size=int(os.environ.get("WORLD_SIZE", 1)))
