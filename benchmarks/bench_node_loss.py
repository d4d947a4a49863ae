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
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

WORLD, NODES = 4, 2
LOST = 1  # the node lost in every trial


def _say(line: str) -> None:
    os.write(1, (line + "\n").encode())  # one write: a line is never split


def child(rank: int, port: int, base: Path, shm: Path, mib: int, step_ms: float, disk_every: int, steps: int) -> None:
    """One rank: resume, say ``resumed <step> <source> <equal> <load s>``, take ``steps`` steps (``step <n>`` after
    each), then wait to be killed; ``steps=0``: exit after the resume."""
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
        said = f"{loaded['step']} {engine.reader.loaded_source} {expected(loaded['step'], loaded['rng'])}"
    except CheckpointNotFoundError:
        said = "0 none True"
    _say(f"resumed {said} {time.perf_counter() - t0:.3f}")
    if steps == 0:
        engine.close()
        dist.barrier()
        dist.destroy_process_group()
        return
    for _ in range(steps):
        time.sleep(step_ms / 1e3)  # the device computes; the host is free
        state["model"]["w"].add_(1.0)
        state["opt"]["m"].add_(2.0)
        state["step"] += 1
        engine.maybe_save(lambda: state, state["step"])
        _say(f"step {state['step']}")
    _say("done")
    sys.stdin.read()  # until killed
    os._exit(0)


class Job:
    """The 4 ranks, each a process of its own with a pipe of its own."""

    def __init__(self, args: argparse.Namespace, base: Path, shm: Path, steps: int) -> None:
        from tests.support.moto_server import free_port

        port = free_port()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        self.t0 = time.perf_counter()
        self.procs = [subprocess.Popen(
            [sys.executable, __file__, "--child", str(r), "--port", str(port), "--dir", str(base), "--shm", str(shm),
             "--mib", str(args.mib), "--step-ms", str(args.step_ms), "--disk-every", str(args.disk_every),
             "--steps", str(steps)], cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            for r in range(WORLD)]

    def resumed(self) -> list[tuple[int, str, bool, float]]:
        out = []
        for r, p in enumerate(self.procs):
            line = p.stdout.readline().split()
            if not line or line[0] != "resumed":
                raise SystemExit(f"rank {r} said {line!r} instead of resuming; its exit code: {p.wait()}")
            out.append((int(line[1]), line[2], line[3] == "True", float(line[4])))
        self.started_s = time.perf_counter() - self.t0  # start to every rank resumed
        return out

    def kill_at(self, step: int) -> int:
        """SIGKILL every rank once rank 0 finished ``step``; the newest step any rank finished."""
        for line in self.procs[0].stdout:
            if line.split() in (["step", str(step)], ["done"]):
                break
        for p in self.procs:
            p.kill()
        reached = 0
        for p in self.procs:
            p.wait()
            for line in p.stdout:  # what each said before it died
                if line.startswith("step "):
                    reached = max(reached, int(line.split()[1]))
            p.stdout.close()
            p.stdin.close()
        return reached

    def exit(self) -> None:
        for r, p in enumerate(self.procs):
            if p.wait(timeout=120) != 0:
                raise SystemExit(f"rank {r} of the last restore exited {p.returncode}")
            p.stdout.close()
            p.stdin.close()


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
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        child(args.child, args.port, Path(args.dir), Path(args.shm), args.mib, args.step_ms, args.disk_every,
              args.steps)
        return 0
    if args.smoke:
        args.trials, args.mib, args.step_ms = 1, 1, 5.0
    base = (Path(args.dir) / "node-loss").absolute()
    shm = Path(args.shm) / f"torch-persist-bench-node-loss-{os.getpid()}"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    rng = random.Random(args.seed)
    rows = []
    try:
        job = Job(args, base, shm, steps=10**6)
        start = job.resumed()
        for trial in range(args.trials):
            at = start[0][0] + rng.randint(5, 25)
            reached = job.kill_at(at)
            bound = min(_held(shm, r) for r in range(WORLD // NODES * LOST, WORLD // NODES * (LOST + 1)))
            remote = _remote_newest(base)
            shutil.rmtree(base / f"node{LOST}")  # node 1 lost: its disk and its host memory
            shutil.rmtree(shm / f"node{LOST}", ignore_errors=True)
            last = trial == args.trials - 1
            job = Job(args, base, shm, steps=0 if last else 10**6)
            resumed = job.resumed()
            steps = {s for s, *_ in resumed}
            rows.append({"reached": reached, "bound": bound, "remote": remote, "resumed": min(steps),
                         "agreed": len(steps) == 1, "sources": [src for _, src, _, _ in resumed],
                         "exact": all(eq for *_, eq, _ in resumed), "load_s": max(t for *_, t in resumed),
                         "started_s": job.started_s})
            start = resumed
        job.exit()
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    print(f"A lost node: {WORLD} gloo ranks as {NODES} nodes, {args.mib} MiB a rank, {args.step_ms:g} ms of device "
          f"time a step, a snapshot every step, a disk save and upload every {args.disk_every}; node {LOST} lost "
          f"{args.trials} times (every process SIGKILLed, node {LOST}'s disk and memory wiped)")
    print()
    print("| trial | reached | newest partner copy | resumed | lost | since the partner copy | sources (ranks 0-3) "
          "| bit-exact | from the remote alone: lost | load (s) | start to resumed (s) |")
    print("|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|")
    for i, r in enumerate(rows):
        print(f"| {i + 1} | {r['reached']} | {r['bound']} | {r['resumed']}{'' if r['agreed'] else ' (ranks disagree)'}"
              f" | {r['reached'] - r['resumed']} | {r['reached'] - r['bound']} | {', '.join(r['sources'])} "
              f"| {'yes' if r['exact'] else 'NO'} | {r['reached'] - r['remote']} | {r['load_s']:.2f} "
              f"| {r['started_s']:.1f} |")
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
