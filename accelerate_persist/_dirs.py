"""The directories Accelerate users name: where ``save_state(dir)`` links to the hook's checkpoints, and plain
Accelerate checkpoints (no manifest) from a run before the hook.

The hook writes every checkpoint to ``local_dir/step-N``; a directory the user names (``output_dir``, or
``ProjectConfiguration``'s automatic ``checkpoints/checkpoint_<iteration>``, :func:`named_dir`) becomes a link
to it once it is committed (:mod:`persist_core.links`, through the session), and retention keeps the steps
such a link still names.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from persist_core import ConfigError
from persist_core.layout import MANIFEST_NAME, is_url

log = logging.getLogger(__name__)


def named_dir(accelerator: Any, output_dir: str | None, local_dir: Path) -> tuple[str | None, bool]:
    """``(the directory the user will look in, whether Accelerate's automatic naming chose it)``.

    Raises:
        ConfigError: that directory exists and is not a link the hook made.
    """
    config = accelerator.project_configuration
    if config.automatic_checkpoint_naming:
        target = os.path.join(accelerator.project_dir, "checkpoints", f"checkpoint_{config.iteration}")
        automatic = True
    elif output_dir is not None:
        target, automatic = os.path.abspath(os.path.expanduser(os.fspath(output_dir))), False
    else:
        return None, False
    if os.path.lexists(target) and not os.path.islink(target):
        raise ConfigError(
            f"save_state: {target} exists and is not a checkpoint PersistHook linked there; the hook writes to "
            f"{local_dir} and makes the directory you name a link to it, so name a new directory "
            "or remove that one"
        )
    return target, automatic


def plain_accelerate_dir(path: str) -> str | None:
    """``path`` when it is a directory of files but not a torch-persist checkpoint (no manifest), else ``None``."""
    if is_url(path):
        return None
    real = os.path.realpath(os.path.expanduser(path.removeprefix("file://")))
    if not os.path.isdir(real) or os.path.exists(os.path.join(real, MANIFEST_NAME)):
        return None
    return real if any(e.is_file() for e in os.scandir(real)) else None


def newest_plain(folder: str) -> str | None:
    """The newest ``checkpoint_<i>`` Accelerate's automatic naming wrote in ``folder`` (plain, no manifest)."""
    try:
        names = [e.name for e in os.scandir(folder) if e.name.startswith("checkpoint_")]
    except FileNotFoundError:
        return None
    numbered = sorted((int(n.removeprefix("checkpoint_")), n) for n in names if n.removeprefix("checkpoint_").isdigit())
    return plain_accelerate_dir(os.path.join(folder, numbered[-1][1])) if numbered else None


def optimizer_steps_of(accelerator: Any) -> int:
    """Optimizer steps a plain Accelerate checkpoint had taken: the ``step`` its optimizer state keeps
    (Adam and friends); 0, with a warning, for an optimizer without one (SGD)."""
    for optimizer in accelerator._optimizers:
        for values in optimizer.state_dict().get("state", {}).values():
            step = values.get("step") if isinstance(values, dict) else None
            if step is not None:
                return int(step)
    log.warning("the loaded Accelerate checkpoint does not say how many optimizer steps it took (its optimizer "
                "keeps no 'step'); counting from 0: the hook's checkpoints are numbered from here on")
    return 0
