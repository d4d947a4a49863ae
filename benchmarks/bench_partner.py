"""Partner copies (issue 42 b): how fast a memory snapshot reaches its partner's memory over gloo, against a raw
gloo send of the same bytes (the floor), two processes on this machine.

The copy is the engine's own: :class:`persist_core.memory.partner.PartnerCopies` reads the committed slot in 64 MiB
chunks, sends them, and the partner writes them into its slot, verifies every block (crc32c) and writes the
record, then acknowledges. The node-loss bound of docs/memory.md is "the steps since the last completed partner
copy": a copy takes about (a rank's state) / (this bandwidth).

Usage: ``python benchmarks/bench_partner.py [--mib 1024] [--reps 3] [--dir bench-out] [--shm /dev/shm]``; ``--smoke``: 8 MiB, once.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common.tables import print_table  # noqa: E402


def _child(rank: int, port: int, base: str, shm: str, mib: int, reps: int) -> None:
    import torch
    import torch.distributed as dist

    from persist_core import CheckpointEngine, MemoryTier
    from persist_core.distributed import TorchCollectives, TorchPointToPoint
    from persist_core.memory import MemoryStore, PartnerCopies

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    p2p = TorchPointToPoint(dist.new_group(backend="gloo"))
    channel = TorchCollectives(dist.new_group(backend="gloo"))  # each copy step agreed, as the engine does
    nbytes = mib << 20
    raw = torch.empty(nbytes, dtype=torch.uint8)
    floor = []
    for _ in range(reps):  # the floor: the same bytes in one gloo send
        dist.barrier()
        t0 = time.perf_counter()
        dist.send(raw, dst=1) if rank == 0 else dist.recv(raw, src=0)
        floor.append(time.perf_counter() - t0)
    if rank == 1:
        held = MemoryStore(Path(shm) / "node1" / "partner-of-rank-00000", identity="nodes-0-1")
        receiver = PartnerCopies(p2p, channel, rank=1, partner=None, source=0, held=held)
        for step in range(1, reps + 1):
            assert receiver.agree(step), "every rank finished the last copy step"
            receiver.skip(step)  # this rank's own snapshot of the copy step: it has none (it only holds)
            dist.barrier()  # the copy is acknowledged
        dist.barrier()  # the sender is done
        receiver.close(finished=True)
        dist.barrier()
        dist.destroy_process_group()
        return
    memory = MemoryTier(memory_dir=Path(shm) / "node0")
    engine = CheckpointEngine(Path(base) / "ckpt", memory=memory)
    sender = PartnerCopies(p2p, channel, rank=0, partner=1, source=None, held=None)
    copies = []
    for step in range(1, reps + 1):
        assert sender.agree(step), "every rank finished the last copy step"
        engine.snapshot({"w": torch.full((nbytes // 4,), float(step)), "step": step}, step)
        engine.wait()
        snap = next(s for s in engine._parts.snapshots.store.snapshots() if s.step == step)
        t0 = time.perf_counter()
        sender.offer(snap)
        sender.flush()
        copies.append(time.perf_counter() - t0)
        assert sender.copied_step == step, "the partner did not keep the copy"
        dist.barrier()
    engine.close()
    dist.barrier()
    sender.close(finished=True)
    dist.barrier()
    dist.destroy_process_group()
    (Path(base) / "result.json").write_text(json.dumps({"floor": floor, "copies": copies, "bytes": nbytes}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default="bench-out")
    parser.add_argument("--shm", default="/dev/shm", help="a tmpfs for both simulated nodes' memory")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.mib, args.reps = 8, 1
    import torch.multiprocessing as mp

    from tests.support.moto_server import free_port

    base = Path(args.dir) / "partner"
    shm = Path(args.shm) / f"torch-persist-bench-partner-{os.getpid()}"  # both "nodes'" memory: a tmpfs
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    try:
        mp.spawn(_child, args=(free_port(), str(base), str(shm), args.mib, args.reps), nprocs=2, join=True)
        result = json.loads((base / "result.json").read_text())
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    gb = result["bytes"] / 1e9
    floor, copy = statistics.median(result["floor"]), statistics.median(result["copies"])
    print_table([f"what ({args.mib} MiB, median of {args.reps})", "s", "GB/s"],
                [["raw gloo send (the floor)", f"{floor:.3f}", f"{gb / floor:.2f}"],
                 ["partner copy: read the slot, 64 MiB chunks, write, verify, record, ack", f"{copy:.3f}",
                  f"{gb / copy:.2f}"]])
    print(f"partner copy / floor: {copy / floor:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
