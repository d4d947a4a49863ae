"""Child for the ownership tests: holds something in ``local_dir`` until its stdin closes, or dies mid-delete.

Modes (``argv[1]``), each printing ``ready <pid>`` once it holds what it holds:

* ``engine DIR``: an open ``CheckpointEngine`` on DIR (its writer lock) with one checkpoint saved.
* ``mark DIR``: an owned temporary directory named with a PID this host does not run (what a writer
  in another PID namespace, or on another host of a shared file system, looks like from here).
* ``die-deleting DIR STEP``: removes checkpoint STEP and is SIGKILLed between the rename that takes
  it out of the checkpoints and the deletion of its files (prints nothing).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import sys
from pathlib import Path

import torch

from persist_core import CheckpointEngine
from persist_core import ownership
from persist_core.layout import owner_filename
from persist_core.tiers.local import LocalTier


def main() -> None:
    mode, root = sys.argv[1], Path(sys.argv[2])
    with contextlib.ExitStack() as held:
        if mode == "engine":
            engine = held.enter_context(CheckpointEngine(root))
            engine.save({"w": torch.ones(16)}, step=1).wait()
        elif mode == "mark":
            name = ".tmp-step-000000000007-pid999999-c0ffee"
            fd = os.open(root / owner_filename(name), os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.pwrite(fd, json.dumps({"host": "other-namespace", "pid": 999999}).encode(), 0)
            (root / name).mkdir()
            (root / name / "rank-00000.safetensors").write_bytes(b"half written")
        elif mode == "die-deleting":
            ownership.shutil.rmtree = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
            LocalTier(root).remove(int(sys.argv[3]))
        print(f"ready {os.getpid()}", flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main()
