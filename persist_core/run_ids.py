"""Which run a ``local_dir`` belongs to: the one rule, for the engine, its readers and the ``persist`` command.

A run's id names its memory snapshots (``memory_dir/<run-id>``) and its lease on the remote. It is, in this order:

* a live run (the engine, and a reader in the same launch: ``persist_core.load``): the ``run_id`` given, else the
  launcher's (``PERSIST_RUN_ID``, torchrun's ``TORCHELASTIC_RUN_ID``, SLURM's ``SLURM_JOB_ID``), else the one kept in
  ``local_dir/.run-id`` (made there at first use, so a restart on the same directory is the same run);
* a stopped run (``stopped=True``: the ``persist`` command, run later from another shell whose launcher variables
  are not that run's): the one kept in ``local_dir`` first, then the launcher's.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from persist_core import _knobs
from persist_core.errors import ConfigError
from persist_core.layout import RUN_ID_NAME
from persist_core.sidefiles import read_side_file, write_side_file

__all__ = ["keep_run_id", "kept_run_id", "run_id_of"]


def run_id_of(root: Path, given: str | None = None, *, stopped: bool = False, create: bool = True) -> str | None:
    """The id of the run ``root`` holds (see the module's docstring); ``create``: make and keep one when there is
    none (a live run's first use), else ``None``.

    Raises:
        ConfigError: ``root/.run-id`` is not UTF-8 text or not a regular file, or a launcher's id is not one the
            layout takes (each named, with the fix).
    """
    if stopped:
        return kept_run_id(root, strict=False) or _knobs.run_id_from_env()
    value = given or _knobs.run_id_from_env() or kept_run_id(root, strict=create)
    if value is None and create:
        value = f"run-{secrets.token_hex(6)}"
        keep_run_id(root, value)
    return value


def kept_run_id(root: Path, *, strict: bool = True) -> str | None:
    """The run id kept in ``root``, or ``None``; ``strict``: one that cannot be read is an error (a writer would
    otherwise start another run on the same directory), else ``None`` (a reader finds no run).

    Raises:
        ConfigError: with ``strict``, ``root/.run-id`` is not UTF-8 text (or not a regular file).
    """
    path = root / RUN_ID_NAME
    try:
        return read_side_file(path).decode().strip() or None
    except FileNotFoundError:
        return None
    except UnicodeDecodeError as e:
        if not strict:
            return None
        raise ConfigError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}), so it names no run: delete it "
                          "(a new run id is made), or pass run_id= (or set PERSIST_RUN_ID) to continue a run") from None
    except (OSError, ConfigError):
        if strict:
            raise
        return None


def keep_run_id(root: Path, value: str) -> None:
    """Write ``value`` as the run id kept in ``root`` (never through a link: :mod:`persist_core.sidefiles`)."""
    write_side_file(root / RUN_ID_NAME, value.encode())
