"""torch-persist's engine: asynchronous, verified PyTorch checkpoints.

Imports neither ``lightning`` nor ``accelerate``; the adapters build on it.
"""

from persist_core.distributed import RankInfo
from persist_core.engine import CheckpointEngine
from persist_core.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    PersistError,
    StepExistsError,
    UnsupportedStateError,
    WriteError,
)
from persist_core.handle import SaveHandle, SaveStats
from persist_core.local_writer import FileOps
from persist_core.restore import CheckpointInfo

__all__ = [
    "CheckpointEngine",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "ConfigError",
    "CorruptCheckpointError",
    "FileOps",
    "PersistError",
    "RankInfo",
    "SaveHandle",
    "SaveStats",
    "StepExistsError",
    "UnsupportedStateError",
    "WriteError",
]
