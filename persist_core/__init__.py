"""torch-persist's engine: asynchronous, verified PyTorch checkpoints.

Imports neither ``lightning`` nor ``accelerate``; the adapters build on it.
"""

from persist_core.policies import (
    AnyOf,
    Continuous,
    DecisionContext,
    EveryNSeconds,
    EveryNSteps,
    KeepEveryNSeconds,
    KeepEveryNSteps,
    KeepLastN,
    KeepSteps,
    OptimalInterval,
    RetentionContext,
    RetentionPolicy,
    SavePolicy,
)
from persist_core.preemption import PreemptionNotice
from persist_core.config import Config
from persist_core.distributed import Collectives, SingleProcess, TorchCollectives
from persist_core.engine import CheckpointEngine
from persist_core.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    DirectoryInUseError,
    PersistError,
    RemoteError,
    ResumeMismatchError,
    ResumeMismatchWarning,
    StepExistsError,
    UnsafeCheckpointError,
    UnsupportedStateError,
    WriteError,
)
from persist_core.format.tree import PerRank
from persist_core.handle import SaveHandle, SaveStats
from persist_core.fileio import FileOps
from persist_core.load.reader import CheckpointReader
from persist_core.memory.option import MemoryTier
from persist_core.tiers.tier import CheckpointInfo

__all__ = [
    "Continuous",
    "DecisionContext",
    "EveryNSeconds",
    "EveryNSteps",
    "OptimalInterval",
    "PreemptionNotice",
    "SavePolicy",
    "AnyOf",
    "CheckpointEngine",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "CheckpointReader",
    "Collectives",
    "Config",
    "ConfigError",
    "CorruptCheckpointError",
    "DirectoryInUseError",
    "FileOps",
    "KeepEveryNSeconds",
    "KeepEveryNSteps",
    "KeepLastN",
    "KeepSteps",
    "MemoryTier",
    "PerRank",
    "PersistError",
    "RemoteError",
    "ResumeMismatchError",
    "ResumeMismatchWarning",
    "RetentionContext",
    "RetentionPolicy",
    "SaveHandle",
    "SaveStats",
    "SingleProcess",
    "StepExistsError",
    "TorchCollectives",
    "UnsafeCheckpointError",
    "UnsupportedStateError",
    "WriteError",
]
