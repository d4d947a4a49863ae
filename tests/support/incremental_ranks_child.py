"""The body of each rank in the multi-rank incremental tests (spawned with torch.multiprocessing): a DDP-like
replicated state with a frozen base, saved incrementally by every rank."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from persist_core import CheckpointEngine, KeepLastN, TorchCollectives


def ddp_state(step: int) -> dict:
    """A frozen base spread over several tensors (the ranks each write some), a trainable adapter and its state."""
    base = {f"layer{i}.weight": torch.randn(256, 256, generator=torch.Generator().manual_seed(1000 + i))
            for i in range(8)}
    adapter = torch.randn(64, 16, generator=torch.Generator().manual_seed(step))
    return {"model": {**base, "adapter": adapter}, "optim": {"exp_avg": adapter * 0.5}, "step": step}


def run(rank: int, world: int, port: int, root: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    coll = TorchCollectives.new_group(timeout_s=60)
    with CheckpointEngine(root, collectives=coll, incremental=True, full_every=3, keep_local=KeepLastN(2)) as engine:
        for step in range(1, 6):
            engine.save(ddp_state(step), step=step).wait()
    with CheckpointEngine(root, collectives=coll) as engine:  # every rank restores the newest
        loaded = engine.load()
    equal = all(torch.equal(a, b) for a, b in zip(loaded["model"].values(), ddp_state(loaded["step"])["model"].values()))
    (Path(out) / f"rank{rank}.json").write_text(json.dumps({"step": loaded["step"], "equal": equal}))
    dist.barrier()
    dist.destroy_process_group()
