"""torch-persist's engine: asynchronous, verified PyTorch checkpoints.

Imports neither ``lightning`` nor ``accelerate``; the adapters build on it.
"""

from persist_core.decisions import (
    Continuous,
    DecisionContext,
    EveryNSeconds,
    EveryNSteps,
    OptimalInterval,
    PreemptionNotice,
    SavePolicy,
)
from persist_core.distributed import Collectives, SingleProcess, TorchCollectives
from persist_core.engine import CheckpointEngine
from persist_core.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    PersistError,
    RemoteError,
    StepExistsError,
    UnsupportedStateError,
    WriteError,
)
from persist_core.handle import SaveHandle, SaveStats
from persist_core.local_writer import FileOps
from persist_core.reader import CheckpointReader
from persist_core.restore import CheckpointInfo
from persist_core.retention import (
    AnyOf,
    KeepEveryNSeconds,
    KeepEveryNSteps,
    KeepLastN,
    KeepSteps,
    RetentionContext,
    RetentionPolicy,
)

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
    "ConfigError",
    "CorruptCheckpointError",
    "FileOps",
    "KeepEveryNSeconds",
    "KeepEveryNSteps",
    "KeepLastN",
    "KeepSteps",
    "PersistError",
    "RemoteError",
    "RetentionContext",
    "RetentionPolicy",
    "SaveHandle",
    "SaveStats",
    "SingleProcess",
    "StepExistsError",
    "TorchCollectives",
    "UnsupportedStateError",
    "WriteError",
]
