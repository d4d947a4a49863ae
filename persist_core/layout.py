"""Every file and directory name torch-persist writes. Nothing else formats or parses names.

A local tier looks like::

    local_dir/
        step-000000000100/                  a committed checkpoint (it holds a manifest)
            manifest.json                   written last
            rank-00000.safetensors          one shard file per rank
        .tmp-step-000000000200-pid4242-1a2b3c/   being written; removed at start if its writer is gone
"""

from __future__ import annotations

import re

MANIFEST_NAME = "manifest.json"

_STEP_DIGITS = 12
_CHECKPOINT_RE = re.compile(r"^step-(\d{%d,})$" % _STEP_DIGITS)
_TMP_RE = re.compile(r"^\.tmp-step-(\d+)-pid(\d+)-[0-9a-f]+$")


def checkpoint_dirname(step: int) -> str:
    """Name of the committed checkpoint directory for ``step``."""
    return f"step-{step:0{_STEP_DIGITS}d}"


def parse_checkpoint_dirname(name: str) -> int | None:
    """The step of a committed checkpoint directory name, or ``None`` for any other name."""
    m = _CHECKPOINT_RE.match(name)
    return int(m.group(1)) if m else None


def tmp_dirname(step: int, pid: int, token: str) -> str:
    """Name of the temporary directory a checkpoint is written into before its rename."""
    return f".tmp-{checkpoint_dirname(step)}-pid{pid}-{token}"


def parse_tmp_dirname(name: str) -> tuple[int, int] | None:
    """``(step, pid)`` of a temporary directory name, or ``None`` for any other name."""
    m = _TMP_RE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def shard_filename(rank: int) -> str:
    """Name of the shard file that ``rank`` writes."""
    return f"rank-{rank:05d}.safetensors"
