"""Child for the crash tests: saves a deterministic state every step until it is killed.

Prints ``saved <step>`` after each ``save`` returns (staged; the write goes on in the background).
"""

from __future__ import annotations

import sys

import torch

from persist_core import CheckpointEngine
from tests.support import states


def state_for(step: int) -> dict:
    optim = {"state": {0: {"exp_avg": torch.randn(512, 512, generator=torch.Generator().manual_seed(-step))}},
             "lr": 0.1 / step}
    return states.state_for(step, (1024, 1024), random=True, bias=torch.half, optim=optim)


def main() -> None:
    local_dir, first = sys.argv[1], int(sys.argv[2])
    engine = CheckpointEngine(local_dir, chunk_bytes=1 << 20)
    step = first
    while True:
        engine.save(state_for(step), step=step)
        print(f"saved {step}", flush=True)
        step += 1


if __name__ == "__main__":
    main()
