"""The body of each rank in the sharded incremental test: an FSDP2 model (``fully_shard`` on a gloo CPU mesh) with a
frozen base and a trainable head, saved incrementally every step; each rank's shards compared after a load."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from persist_core import CheckpointEngine, TorchCollectives


def model() -> torch.nn.Module:
    torch.manual_seed(5)
    base = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    for p in base.parameters():
        p.requires_grad_(False)
    return torch.nn.Sequential(base, torch.nn.Linear(256, 8))


def run(rank: int, world: int, port: int, root: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    m = model()
    fully_shard(m, mesh=mesh)
    opt = torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=0.1)
    g = torch.Generator().manual_seed(3)
    saved = {}
    with CheckpointEngine(root, collectives=TorchCollectives.new_group(timeout_s=60), incremental=True,
                          full_every=5, remote_url=(Path(out) / "remote").as_uri()) as engine:
        for step in range(1, 4):
            m(torch.randn(4, 256, generator=g)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
            state = {"model": m.state_dict(), "optim": opt.state_dict(), "step": step}
            engine.save(state, step).wait()
            saved[step] = {k: v.full_tensor().clone() for k, v in m.state_dict().items()}
        target = {"model": model_target(mesh), "step": 0}
        engine.load(2, into=target)
        same = all(torch.equal(v.full_tensor(), saved[2][k]) for k, v in target["model"].items())
    torch.save({"saved": saved, "into_equal": same}, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def model_target(mesh) -> dict:
    from torch.distributed.fsdp import fully_shard

    fresh = torch.nn.Sequential(torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]),
                                torch.nn.Linear(256, 8))
    fully_shard(fresh, mesh=mesh)
    return fresh.state_dict()
