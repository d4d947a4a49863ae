"""Child for the memory tier's kill trials: resumes from the freshest source, then snapshots every step in memory
and saves to disk every ``disk_every`` steps, until it is killed.

Prints ``resumed <step>`` once (-1: nothing to resume), then ``step <k>`` after each ``maybe_save`` returns.
"""

from __future__ import annotations

import sys

from persist_core import CheckpointEngine, CheckpointNotFoundError, EveryNSteps, MemoryTier
from tests.support import states


def state_for(step: int) -> dict:
    return states.state_for(step, (256, 256), random=True, bias=None)


def main() -> None:
    local_dir, memory_dir, disk_every = sys.argv[1], sys.argv[2], int(sys.argv[3])
    engine = CheckpointEngine(local_dir, memory=MemoryTier(every_n_steps=1, memory_dir=memory_dir),
                              save_policy=EveryNSteps(disk_every), chunk_bytes=1 << 20, preemption=None)
    try:
        resumed = engine.load()["step"]
    except CheckpointNotFoundError:
        resumed = -1
    print(f"resumed {resumed}", flush=True)
    step = resumed + 1
    while True:
        engine.maybe_save(lambda: state_for(step), step)
        print(f"step {step}", flush=True)
        step += 1


if __name__ == "__main__":
    main()
