"""A lost node, as a kill-trial series (issue 42 b): 4 gloo ranks as 2 simulated nodes, node 1 lost again and again.

Each node has its own ``local_dir`` (its NVMe: the engine finds out the nodes from them) and ``memory_dir`` (its host
memory); the job trains with ``MemoryTier(every_n_steps=1)`` (each rank's newest snapshot also goes to the same local
rank on the other node), a disk save every ``--disk-every`` steps and a ``file://`` remote. Each step waits
``--step-ms`` of "device time" with the host free, then updates the state in place (``--mib`` MiB a rank: a
model and its optimizer state, replicated as in data parallel training, and an RNG state of each rank's own). A trial: the job resumes (``engine.load()``, every rank agreeing), trains a
random 5 to 25 steps, then every process is SIGKILLed and node 1's memory and disk are wiped (a machine lost; node
0's processes die with the job, their memory stays). The next trial's job is its restart.

Per trial: the step the job reached; the newest step node 0 held a whole partner copy of for each of node 1's ranks
(the bound: a lost node loses the steps since then); the step the restart resumed from and the source each rank read
(``memory``: its own, ``partner``: from the other node, ``local``, ``remote``); whether every rank's state was the
state of that step bit for bit; what a restore from the remote alone (no partner copies) would have lost; the load's
time. Bars (issue 42): steps lost <= the steps since the last partner copy, nothing read from the remote, bit-exact.

Usage: ``python benchmarks/bench_node_loss.py [--trials 10] [--mib 64] [--step-ms 80] [--disk-every 50] [--dir
bench-out] [--shm /dev/shm]``; ``--smoke``: 1 MiB, one trial.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common.kills import kill_series  # noqa: E402
from benchmarks._common.tables import print_table  # noqa: E402

WORLD, NODES = 4, 2
LOST = 1  # the node lost in every trial


def _say(**event: object) -> None:
    os.write(1, (json.dumps(event) + "\n").encode())  # one write: a line is never split


def child(rank: int, port: int, base: Path, shm: Path, mib: int, step_ms: float, disk_every: int) -> None:
    """One rank: resume, say so (the ``start`` event of :mod:`benchmarks._common.kills`, with the source it read,
    whether its state is that step's bit for bit, and the load's seconds), then train until killed (a ``step`` event
    after each step)."""
    import torch
    import torch.distributed as dist

    from persist_core import CheckpointEngine, CheckpointNotFoundError, EveryNSteps, KeepLastN, MemoryTier, PerRank
    from persist_core import TorchCollectives

    torch.set_num_threads(1)
    node = rank // (WORLD // NODES)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    coll = TorchCollectives.new_group(timeout_s=120)
    engine = CheckpointEngine(base / f"node{node}" / "ckpt", collectives=coll, save_policy=EveryNSteps(disk_every),
                              keep_local=KeepLastN(2), remote_url=(base / "remote").as_uri(), preemption=None,
                              memory=MemoryTier(every_n_steps=1, memory_dir=shm / f"node{node}"))
    n = (mib << 20) // 8  # two float32 tensors of mib / 2 MiB each
    pattern = torch.arange(n, dtype=torch.float32).remainder_(4096)
    state = {"model": {"w": pattern.clone()}, "opt": {"m": pattern.clone()}, "step": 0,
             "rng": PerRank(torch.tensor([rank]))}  # data parallel: replicated but for the RNG

    def expected(step: int, rng: object) -> bool:  # the state every rank holds at ``step``: integers, exact in float32
        return (state["step"] == step and torch.equal(state["model"]["w"], pattern + step)
                and torch.equal(state["opt"]["m"], pattern + 2 * step) and torch.equal(rng, torch.tensor([rank])))

    t0 = time.perf_counter()
    try:
        loaded = engine.load()
        state["model"]["w"].copy_(loaded["model"]["w"])
        state["opt"]["m"].copy_(loaded["opt"]["m"])
        state["step"] = loaded["step"]
        said = {"step": loaded["step"], "source": engine.reader.loaded_source,
                "exact": expected(loaded["step"], loaded["rng"])}
    except CheckpointNotFoundError:
        said = {"step": 0, "source": "none", "exact": True}
    _say(event="start", **said, load_s=time.perf_counter() - t0)
    while True:
        time.sleep(step_ms / 1e3)  # the device computes; the host is free
        state["model"]["w"].add_(1.0)
        state["opt"]["m"].add_(2.0)
        state["step"] += 1
        engine.maybe_save(lambda: state, state["step"])
        _say(event="step", step=state["step"])


def _commands(args: argparse.Namespace, base: Path, shm: Path) -> list[list[str]]:
    """The 4 ranks of one start of the job, on a fresh port."""
    from tests.support.moto_server import free_port

    port = free_port()
    return [[sys.executable, __file__, "--child", str(r), "--port", str(port), "--dir", str(base), "--shm", str(shm),
             "--mib", str(args.mib), "--step-ms", str(args.step_ms), "--disk-every", str(args.disk_every)]
            for r in range(WORLD)]


def _lose_node(base: Path, shm: Path) -> dict[str, int]:
    """After the kill: what node 0 holds of node 1's ranks and what the remote holds, then node 1 lost (its disk
    and its host memory wiped)."""
    bound = min(_held(shm, r) for r in range(WORLD // NODES * LOST, WORLD // NODES * (LOST + 1)))
    remote = _remote_newest(base)
    shutil.rmtree(base / f"node{LOST}")
    shutil.rmtree(shm / f"node{LOST}", ignore_errors=True)
    return {"bound": bound, "remote": remote}


def _held(shm: Path, rank: int) -> int:
    """The newest step node 0 holds a whole partner copy of for ``rank`` (0: none)."""
    records = (shm / "node0").glob(f"*/partner-of-rank-{rank:05d}/life-*/slot-*.json")
    return max((json.loads(p.read_text())["step"] for p in records), default=0)


def _remote_newest(base: Path) -> int:
    from persist_core.layout import parse_checkpoint_dirname

    steps = [parse_checkpoint_dirname(p.parent.name) for p in (base / "remote").glob("step-*/manifest*.json")]
    return max((s for s in steps if s is not None), default=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--mib", type=int, default=64, help="each rank's state, MiB")
    parser.add_argument("--step-ms", type=float, default=80.0, help="device time of a step")
    parser.add_argument("--disk-every", type=int, default=50, help="a disk save (and its upload) every N steps")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--dir", default="bench-out")
    parser.add_argument("--shm", default="/dev/shm", help="a tmpfs for both simulated nodes' memory")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        child(args.child, args.port, Path(args.dir), Path(args.shm), args.mib, args.step_ms, args.disk_every)
        return 0
    if args.smoke:
        args.trials, args.mib, args.step_ms = 1, 1, 5.0
    base = (Path(args.dir) / "node-loss").absolute()
    shm = Path(args.shm) / f"torch-persist-bench-node-loss-{os.getpid()}"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    rng = random.Random(args.seed)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    try:
        series = kill_series(lambda: _commands(args, base, shm), args.trials, lambda: rng.randint(5, 25), env=env,
                             between=lambda killed: _lose_node(base, shm))
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    rows = []
    for kill in series:
        steps = {s["step"] for s in kill.restart.starts}
        rows.append({"reached": kill.killed.last, **kill.noted, "resumed": kill.restart.resumed,
                     "agreed": len(steps) == 1, "sources": [s["source"] for s in kill.restart.starts],
                     "exact": all(s["exact"] for s in kill.restart.starts),
                     "load_s": max(s["load_s"] for s in kill.restart.starts), "started_s": kill.restart.started_s})
    print(f"A lost node: {WORLD} gloo ranks as {NODES} nodes, {args.mib} MiB a rank, {args.step_ms:g} ms of device "
          f"time a step, a snapshot every step, a disk save and upload every {args.disk_every}; node {LOST} lost "
          f"{args.trials} times (every process SIGKILLed, node {LOST}'s disk and memory wiped)")
    print_table(["trial", "reached", "newest partner copy", "resumed", "lost", "since the partner copy",
                 "sources (ranks 0-3)", "bit-exact", "from the remote alone: lost", "load (s)", "start to resumed (s)"],
                [[i + 1, r["reached"], r["bound"], f"{r['resumed']}{'' if r['agreed'] else ' (ranks disagree)'}",
                  r["reached"] - r["resumed"], r["reached"] - r["bound"], ", ".join(r["sources"]),
                  "yes" if r["exact"] else "NO", r["reached"] - r["remote"], f"{r['load_s']:.2f}",
                  f"{r['started_s']:.1f}"] for i, r in enumerate(rows)], align="rrrrrrllrrr")
    within = sum(r["reached"] - r["resumed"] <= r["reached"] - r["bound"] and r["agreed"] for r in rows)
    no_remote = sum("remote" not in r["sources"] for r in rows)
    exact = sum(r["exact"] for r in rows)
    lost = [r["reached"] - r["resumed"] for r in rows]
    alone = [r["reached"] - r["remote"] for r in rows]
    print()
    print(f"steps lost: P50 {statistics.median(lost):g}, max {max(lost)} (from the remote alone: P50 "
          f"{statistics.median(alone):g}, max {max(alone)}); lost <= the steps since the last partner copy: "
          f"{within} of {len(rows)}; nothing read from the remote: {no_remote} of {len(rows)}; bit-exact: {exact} of "
          f"{len(rows)}; load P50 {statistics.median(r['load_s'] for r in rows):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
