"""One rank of the memory tier's several-rank tests (issue 42 b), a plain process (the test SIGKILLs it).

``python -m tests.support.memory_ranks_child RANK WORLD PORT BASE NODES STEPS``: ranks ``R`` of ``WORLD`` in
``NODES`` simulated nodes (ranks ``[n * WORLD/NODES, (n+1) * WORLD/NODES)`` are node ``n``, each node with its own
``BASE/node<n>/ckpt`` (its NVMe: the engine finds out the nodes from them) and ``BASE/node<n>/shm`` (its host
memory)). It resumes from the freshest source (``engine.load()``, every rank agreeing), checks the state bit for bit,
prints ``resumed <step> <source> <equal>`` (the source the state was read from: ``memory``, ``partner``, ``local``,
``remote``; ``-1 none`` when there was nothing), then takes
``STEPS`` more steps (a snapshot every step, a disk save every 5th; after each, ``engine.wait()``: its snapshot and
its partner copy are done) and prints ``ready <step>``; then it waits to be killed. ``STEPS=0``: it closes and exits after the resume.
A seventh argument ``free``: no ``engine.wait()`` between steps (the partner copies run behind the snapshots, as in
training), and after ``ready`` the rank goes on taking steps until it is killed (the kill lands in the middle of
snapshots and copies).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def node_of(rank: int, world: int, nodes: int) -> int:
    return rank // (world // nodes)


def state_for(step: int, rank: int) -> dict:
    """What every rank holds at ``step``: a replicated model (tied weights, a view) and what is its own."""
    from persist_core import PerRank

    g = torch.Generator().manual_seed(step)
    w = torch.randn(256, 256, generator=g)
    return {"model": {"w": w, "tied": w, "row": w[7]}, "opt": {"m": torch.randn(256, 256, generator=g)},
            "step": step, "rng": PerRank(torch.tensor([rank * 1000 + step]))}


def equal(loaded: dict, step: int, rank: int) -> bool:
    want = state_for(step, rank)
    m = loaded["model"]
    shared = m["tied"].untyped_storage().data_ptr() == m["w"].untyped_storage().data_ptr() == \
        m["row"].untyped_storage().data_ptr()
    rng = loaded["rng"].value if hasattr(loaded["rng"], "value") else loaded["rng"]
    return (loaded["step"] == step and shared and torch.equal(rng, want["rng"].value)
            and all(torch.equal(m[k], want["model"][k]) for k in ("w", "tied", "row"))
            and torch.equal(loaded["opt"]["m"], want["opt"]["m"]))


def main() -> None:
    from persist_core import CheckpointEngine, CheckpointNotFoundError, EveryNSteps, MemoryTier, TorchCollectives

    rank, world, port, base, nodes, steps = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
                                             int(sys.argv[5]), int(sys.argv[6]))
    free = sys.argv[7:] == ["free"]
    node = Path(base) / f"node{node_of(rank, world, nodes)}"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    coll = TorchCollectives.new_group(timeout_s=60)
    engine = CheckpointEngine(node / "ckpt", collectives=coll, save_policy=EveryNSteps(5), preemption=None,
                              memory=MemoryTier(every_n_steps=1, memory_dir=node / "shm"), chunk_bytes=1 << 20)
    try:
        loaded = engine.load()
        print(f"resumed {loaded['step']} {engine.reader.loaded_source} {equal(loaded, loaded['step'], rank)}", flush=True)
        start = loaded["step"] + 1
    except CheckpointNotFoundError:
        print("resumed -1 none True", flush=True)
        start = 1
    if steps == 0:
        engine.close()
        dist.barrier()
        dist.destroy_process_group()
        return
    step = start
    while free or step < start + steps:
        engine.maybe_save(lambda: state_for(step, rank), step)
        if not free:
            engine.wait()  # each snapshot and its partner copy done: the slots each node holds do not depend on timing
        if step == start + steps - 1:
            sys.stdout.flush()  # the line in one write: a print may write "\n" on its own
            os.write(1, f"ready {step}\n".encode())
        step += 1
    sys.stdin.read()  # until killed
    os._exit(0)


if __name__ == "__main__":
    main()


def sharded(rank: int, world: int, port: int, base: str, out: str, phase: str) -> None:
    """A state with DTensor leaves (one sharded, one replicated) on ``world`` ranks. ``phase="train"``: steps 1-3,
    a snapshot every step and a disk save every 2nd, then SIGKILL (the snapshots stay). ``"restore"``: a load into
    sharded targets (each rank from its own snapshot of its own part) and a whole load (the newest whole
    checkpoint: the disk's); what each gave goes to ``out``."""
    import signal

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from persist_core import CheckpointEngine, EveryNSteps, MemoryTier, TorchCollectives

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    coll, mesh = TorchCollectives.new_group(timeout_s=60), init_device_mesh("cpu", (world,))
    full = torch.arange(64.0).reshape(8, 8)

    def state(step: int) -> dict:
        return {"d": distribute_tensor(full * step, mesh, [Shard(0)]),
                "r": distribute_tensor(full + step, mesh, [Replicate()]), "plain": torch.ones(3) * step, "step": step}

    engine = CheckpointEngine(base, collectives=coll, save_policy=EveryNSteps(2), preemption=None,
                              memory=MemoryTier(memory_dir=Path(base) / "shm"))
    if phase == "train":
        for step in (1, 2, 3):
            engine.maybe_save(lambda: state(step), step)
        engine.wait()
        dist.barrier()
        os.kill(os.getpid(), signal.SIGKILL)
    into = engine.load(into=state(0))
    got = {"into": (into["step"], engine.reader.loaded_source,
                    all(torch.equal(into[k].to_local(), state(3)[k].to_local()) for k in ("d", "r"))
                    and torch.equal(into["plain"], state(3)["plain"]))}
    whole = engine.load()
    got["whole"] = (whole["step"], engine.reader.loaded_source, torch.equal(whole["d"], full * 2))
    engine.close()
    torch.save(got, Path(out) / f"sharded-rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
