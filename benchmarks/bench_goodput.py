"""Goodput under failures: fixed intervals against ``Continuous`` and ``OptimalInterval``.

A training job (CPU, a 4 x Linear(--width) model with Adam) must reach ``--steps`` steps. It
is SIGKILLed at random times — exponential inter-arrival with mean ``--mtbf`` seconds, the same
failure times for every policy — and restarted, resuming from the newest committed checkpoint
with ``engine.maybe_save`` deciding when to save (``keep_local=KeepLastN(2)``). Each policy
runs once per failure sequence (``--seeds``). Per policy:

* goodput: steps / total wall time over all sequences, restarts included (higher is better);
* work lost per failure: steps done after the last committed checkpoint, redone after a restart;
* from ``engine.summary()`` of the last, uninterrupted, run: the P50 checkpoint interval, the
  fraction of time stalled by saves, the median save duration (call to committed), and how much
  slower training runs while a save is being written than while none is.

Bars (issue 6): continuous reaches a P50 interval no longer than 2x the save's own duration,
and goodput at least as good as the best fixed interval tried.

The run also prints the Young/Daly view of the result: with ``C`` the cost of one save to
training (its stall plus the slowdown of the steps it overlaps) and ``D`` its duration, saving
every ``T`` costs about ``C/T + (T/2 + D)/MTBF`` of the run; continuous (``T = D``) is the best
interval only when ``sqrt(2 C MTBF) <= D``, i.e. when failures come at least every ``D^2 / 2C``.

Usage: ``python benchmarks/bench_goodput.py [--steps 300] [--mtbf 30] [--seeds 2] [--width 1536]
[--dir bench-out]``
"""

from __future__ import annotations

import argparse
import json
import math
import random
import selectors
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from persist_core.tiers.local import committed_steps  # noqa: E402


def child(local_dir: str, policy_text: str, steps: int, width: int) -> None:
    sys.path.insert(0, str(ROOT))
    import torch

    from persist_core import (  # noqa: F401
        CheckpointEngine, CheckpointNotFoundError, Continuous, EveryNSteps, KeepLastN, OptimalInterval)

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    engine = CheckpointEngine(local_dir, save_policy=eval(policy_text), keep_local=KeepLastN(2))
    start = 0
    try:
        state = engine.load()
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = state["step"]
    except CheckpointNotFoundError:
        pass
    print(json.dumps({"event": "start", "step": start}), flush=True)
    x = torch.randn(64, width)
    for step in range(start + 1, steps + 1):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        engine.maybe_save(lambda: {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, step=step)
        print(json.dumps({"event": "step", "step": step}), flush=True)
    engine.wait()
    print(json.dumps({"event": "done", "summary": engine.summary()}), flush=True)
    engine.close()


def run_policy(policy: str, args: argparse.Namespace, failures: list[float], local: Path) -> dict:
    """One job to ``--steps`` under ``policy``, killed at ``failures`` (seconds after each start)."""
    shutil.rmtree(local, ignore_errors=True)
    t0 = time.perf_counter()
    lost, kills, done = [], 0, None
    failure_iter = iter(failures)
    while done is None:
        deadline = time.perf_counter() + next(failure_iter, 1e9)
        proc = subprocess.Popen([sys.executable, __file__, "--child", str(local), "--policy", policy, "--steps",
                                 str(args.steps), "--width", str(args.width)], stdout=subprocess.PIPE, text=True)
        reached = None
        # read progress until the failure time; the child prints one line per step
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.perf_counter()
            if left <= 0:
                proc.send_signal(signal.SIGKILL)
                kills += 1
                break
            if not sel.select(timeout=left):
                continue
            line = proc.stdout.readline()
            if not line:
                break
            ev = json.loads(line)
            if ev["event"] == "step":
                reached = ev["step"]
            elif ev["event"] == "done":
                done = ev
        proc.wait()
        proc.stdout.close()
        if done is None and reached is not None:  # how far the next run starts: the newest committed checkpoint
            lost.append(reached - (max(committed_steps(local), default=0) if local.exists() else 0))
    wall = time.perf_counter() - t0
    shutil.rmtree(local, ignore_errors=True)
    return {"wall_s": wall, "failures": kills, "lost": lost, "done": done}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--mtbf", type=float, default=30.0, help="mean seconds between failures")
    parser.add_argument("--seeds", type=int, default=2, help="failure sequences; every policy runs each")
    parser.add_argument("--width", type=int, default=1536)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--dir", default="bench-out")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--policy", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.policy, args.steps, args.width)
        return
    out = Path(args.dir).absolute() / "goodput"
    out.mkdir(parents=True, exist_ok=True)
    sequences = []
    for k in range(args.seeds):
        rng = random.Random(args.seed + k)
        sequences.append([rng.expovariate(1 / args.mtbf) for _ in range(200)])
    policies = [("every 10 steps", "EveryNSteps(10)"), ("every 40 steps", "EveryNSteps(40)"),
                ("every 120 steps", "EveryNSteps(120)"), ("continuous", "Continuous()"),
                (f"optimal (mtbf {args.mtbf:g} s)", f"OptimalInterval(mtbf_s={args.mtbf})")]
    state_gb = 4 * (args.width * args.width + args.width) * 4 * 3 / 1e9
    print(f"{args.steps} steps of 4 x Linear({args.width}) + Adam (state {state_gb:.2f} GB); SIGKILL with MTBF "
          f"{args.mtbf:g} s; {args.seeds} failure sequences, the same for every policy (policies interleaved)")
    runs: dict[str, list[dict]] = {name: [] for name, _ in policies}
    for k, failures in enumerate(sequences):  # interleaved, so drift on a shared machine hits every policy alike
        for name, policy in policies:
            r = run_policy(policy, args, failures, out / name.replace(" ", "-"))
            runs[name].append(r)
            print(f"  sequence {k}: {name}: {r['wall_s']:.1f} s, {r['failures']} failures", flush=True)
    print("\n| policy | goodput (steps/s) | failures | work lost / failure (steps) | P50 interval | save duration "
          "| stalled | step slower while writing |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")

    def secs(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f} s"

    def pct(v: float | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    def med(values: list) -> float | None:
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    rows = {}
    for name, _ in policies:
        rs = runs[name]
        lost = [x for r in rs for x in r["lost"]]
        summaries = [r["done"]["summary"] for r in rs]  # engine.summary() of each last, uninterrupted run
        row = {
            "goodput": args.steps * len(rs) / sum(r["wall_s"] for r in rs),
            "failures": sum(r["failures"] for r in rs),
            "lost": statistics.mean(lost) if lost else 0.0,
            "p50": med([s["interval_p50_s"] for s in summaries]),
            "stalled": med([s["stall_fraction"] for s in summaries]),
            "save_s": med([s["save_p50_s"] for s in summaries]),
            "stall_s": med([s["stall_p50_s"] for s in summaries]),
            "slowdown": med([s["write_slowdown"] for s in summaries]),
        }
        rows[name] = row
        print(f"| {name} | {row['goodput']:.2f} | {row['failures']} | {row['lost']:.1f} | {secs(row['p50'])} | "
              f"{secs(row['save_s'])} | {pct(row['stalled'], '.1%')} | "
              f"{pct(row['slowdown'], '+.0%')} |")
    names = [n for n, _ in policies]
    best_fixed = max(rows[n]["goodput"] for n in names[:3])
    cont = rows["continuous"]
    ratio = "-" if not cont["p50"] or not cont["save_s"] else f"{cont['p50'] / cont['save_s']:.2f}x"
    print(f"\ncontinuous: P50 interval / save duration = {ratio} (bar <= 2x); "
          f"goodput / best fixed = {cont['goodput'] / best_fixed:.2f}x (bar >= 1x)")
    slow = med([r["slowdown"] for r in rows.values()]) or 0.0  # continuous has few steps without a write
    if cont["stall_s"] and cont["save_s"]:
        cost = cont["stall_s"] + slow * cont["save_s"]
        print(f"Young/Daly: one save costs training C = {cont['stall_s']:.3f} s stall + {slow:.0%} slower steps over "
              f"its {cont['save_s']:.2f} s = {cost:.3f} s; the best interval sqrt(2 C MTBF) = "
              f"{math.sqrt(2 * cost * args.mtbf):.2f} s; continuous (every {cont['save_s']:.2f} s) is the best "
              f"policy only when failures come at least every D^2/2C = {cont['save_s'] ** 2 / (2 * cost):.2f} s")


if __name__ == "__main__":
    main()
