"""Child for the crash tests: saves a deterministic state every step until it is killed.

Prints ``saved <step>`` after each ``save`` returns (staged; the write goes on in the background).
``python -m tests.support.crash_child LOCAL_DIR FIRST_STEP [incremental]``: with ``incremental``, a state with a
frozen base saved incrementally (a full checkpoint every third save, the newest two kept: retention removes
checkpoints that others reference only with them). ``incremental-remote URL ENDPOINT``: the same, uploading to the S3
``URL`` at ``ENDPOINT`` (the moto server), the newest two kept there too; from a ``FIRST_STEP`` above 1 it resumes
(``engine.load()``) first.
"""

from __future__ import annotations

import sys

import torch

from persist_core import CheckpointEngine, KeepLastN
from tests.support import states


def state_for(step: int) -> dict:
    optim = {"state": {0: {"exp_avg": torch.randn(512, 512, generator=torch.Generator().manual_seed(-step))}},
             "lr": 0.1 / step}
    return states.state_for(step, (1024, 1024), random=True, bias=torch.half, optim=optim)


def incremental_state_for(step: int) -> dict:
    """A frozen base (the same bytes at every step) and a small trainable part that changes every step."""
    base = torch.randn(768, 1024, generator=torch.Generator().manual_seed(7))
    head = torch.randn(64, 64, generator=torch.Generator().manual_seed(step))
    return {"model": {"base": base, "head": head}, "optim": {"exp_avg": head * 0.5}, "step": step}


def main() -> None:
    local_dir, first = sys.argv[1], int(sys.argv[2])
    mode = sys.argv[3:]
    if mode == ["incremental"]:
        engine = CheckpointEngine(local_dir, incremental=True, full_every=3, keep_local=KeepLastN(2))
        make = incremental_state_for
    elif mode[:1] == ["incremental-remote"]:
        engine = CheckpointEngine(local_dir, incremental=True, full_every=3, keep_local=KeepLastN(2),
                                  remote_url=mode[1], keep_remote=KeepLastN(2),
                                  storage_options={"client_kwargs": {"endpoint_url": mode[2]}})
        if first > 1:  # a restart resumes the run (a run that loaded nothing is not let beside its checkpoints)
            engine.load()
        make = incremental_state_for
    else:
        engine = CheckpointEngine(local_dir, chunk_bytes=1 << 20)
        make = state_for
    step = first
    while True:
        engine.save(make(step), step=step)
        print(f"saved {step}", flush=True)
        step += 1


if __name__ == "__main__":
    main()
