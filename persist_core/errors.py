"""The exception tree of torch-persist.

Every error the library raises on purpose derives from :class:`PersistError`, and from the
builtin whose meaning matches, so callers can catch either::

    PersistError(Exception)
    ├── ConfigError(PersistError, ValueError)         bad argument or environment; the message names the fix
    │   ├── StepExistsError                           a step that is already committed or pending
    │   └── DirectoryInUseError                       another live writer holds local_dir (named)
    ├── UnsupportedStateError(PersistError, TypeError) a state leaf that cannot be checkpointed
    ├── CheckpointNotFoundError(PersistError, FileNotFoundError)
    ├── CorruptCheckpointError(PersistError)          a manifest, size or checksum that does not verify
    ├── ResumeMismatchError(PersistError)             the state a run resumes with differs from the checkpoint
    ├── WriteError(PersistError, OSError)             a failed write; earlier checkpoints are intact
    └── RemoteError(PersistError, OSError)            a remote operation failed for good; local copies are intact

Background errors (a failed write) are raised exactly once: by the first ``wait()`` or ``save()``
that observes them.

One warning goes with the tree: :class:`ResumeMismatchWarning` (a ``UserWarning``), what
``verify_resume="warn"`` (the default) issues where ``"raise"`` raises :class:`ResumeMismatchError`.
"""

from __future__ import annotations

import pickle

__all__ = [
    "CheckpointNotFoundError",
    "ConfigError",
    "CorruptCheckpointError",
    "DirectoryInUseError",
    "PersistError",
    "RemoteError",
    "ResumeMismatchError",
    "ResumeMismatchWarning",
    "StepExistsError",
    "UnsafeCheckpointError",
    "UnsupportedStateError",
    "WriteError",
]


class PersistError(Exception):
    """Base of every error torch-persist raises on purpose."""


class ConfigError(PersistError, ValueError):
    """An argument or the environment is not usable; the message names the value and the fix."""


class StepExistsError(ConfigError):
    """A checkpoint for this step is already committed or being written."""


class DirectoryInUseError(ConfigError):
    """Another live process holds the writer lock of this ``local_dir`` and rank (the message names it).

    ``this_process``: the holder is this very process (an engine it opened earlier and has not closed).
    """

    this_process: bool = False


class UnsupportedStateError(PersistError, TypeError):
    """A leaf of the state cannot be checkpointed (the message names its key path)."""


class CheckpointNotFoundError(PersistError, FileNotFoundError):
    """No committed checkpoint matches the request."""


class CorruptCheckpointError(PersistError):
    """A checkpoint's manifest, file sizes or checksums do not verify."""


class ResumeMismatchError(PersistError):
    """The state a run resumes with differs from the checkpoint it loaded (``verify_resume="raise"``); the message
    names each differing key path. ``keys``: those key paths."""

    def __init__(self, message: str, keys: list[str] | None = None) -> None:
        super().__init__(message)
        self.keys = list(keys or [])


class ResumeMismatchWarning(UserWarning):
    """The state a run resumes with differs from the checkpoint it loaded (``verify_resume="warn"``, the default);
    the message names each differing key path."""


class UnsafeCheckpointError(PersistError, pickle.UnpicklingError):
    """A leaf of the checkpoint names a type that loading with ``weights_only=True`` (the default) does
    not unpickle; the message names it and the opt-in (``weights_only=False``, for trusted checkpoints).
    Not a corrupt checkpoint: ``load()`` does not fall back to an older one."""


class WriteError(PersistError, OSError):
    """Writing a checkpoint failed; nothing was committed and earlier checkpoints are intact."""


class RemoteError(PersistError, OSError):
    """A remote operation failed for good (after retries); local checkpoints are untouched."""
