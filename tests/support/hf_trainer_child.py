"""Child for the HF Trainer's memory-tier crash test: trains with ``PersistTrainerCallback(memory_every_n_steps=1)``
(disk saves every 4 steps) and SIGKILLs itself at the end of step ``kill_at``, after the callback's snapshot and once
the disk save of step 4 is committed (it is written in the background: a kill two steps later could otherwise come
before its commit, and the test asserts the disk holds it).

Usage: ``python -m tests.support.hf_trainer_child OUT LOCAL_DIR MEMORY_DIR KILL_AT``.
"""

from __future__ import annotations

import os
import signal
import sys

from transformers import TrainerCallback

from accelerate_persist import PersistTrainerCallback
from tests.adapters.test_hf_trainer import run


class KillAt(TrainerCallback):
    def __init__(self, step: int, persist: PersistTrainerCallback) -> None:
        self.step, self.persist = step, persist

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.persist.wait()
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    out, local_dir, memory_dir, kill_at = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    callback = PersistTrainerCallback(local_dir=local_dir, memory_every_n_steps=1, memory_dir=memory_dir)
    run(out, [callback, KillAt(kill_at, callback)], save_steps=4)


if __name__ == "__main__":
    main()
