"""Goodput under failures: fixed intervals against ``Continuous`` and ``OptimalInterval``.

A training job (CPU, a 4 x Linear(--width) model with Adam) must reach ``--steps`` steps. It
is SIGKILLed at random times — exponential inter-arrival with mean ``--mtbf`` seconds, the same
failure times for every policy — and restarted, resuming from the newest committed checkpoint
with ``engine.maybe_save`` deciding when to save. Per policy:

* goodput: ``--steps`` / total wall time, restarts included (higher is better);
* work lost per failure: steps done after the last committed checkpoint, redone after a restart;
* P50 checkpoint interval and the fraction of time stalled by saves (from ``engine.summary()``
  of the last, uninterrupted, run) and the median save duration (call to committed).

Bars (issue 6): continuous reaches a P50 interval no longer than 2x the save's own duration,
and goodput at least as good as the best fixed interval tried.

Usage: ``python benchmarks/bench_goodput.py [--steps 300] [--mtbf 8] [--width 1536] [--dir bench-out]``
"""

from __future__ import annotations

import argparse
import json
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

from persist_core.restore import committed_steps  # noqa: E402


def child(local_dir: str, policy_text: str, steps: int, width: int) -> None:
    sys.path.insert(0, str(ROOT))
    import torch

    from persist_core import CheckpointEngine, CheckpointNotFoundError, Continuous, EveryNSteps, OptimalInterval  # noqa: F401

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    engine = CheckpointEngine(local_dir, save_policy=eval(policy_text), keep_local=None)
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
    done = [h.stats for _, _, h in list(engine._history)[-5:] if h.stats.commit_s is not None]
    print(json.dumps({"event": "done", "summary": engine.summary(),
                      "save_s": statistics.median(s.stall_s + s.commit_s for s in done) if done else None}), flush=True)
    engine.close()


def run_policy(name: str, policy: str, args: argparse.Namespace, failures: list[float], out: Path) -> dict:
    local = out / name
    shutil.rmtree(local, ignore_errors=True)
    t0 = time.perf_counter()
    lost, kills, last_summary, save_s = [], 0, None, None
    failure_iter = iter(failures)
    while True:
        deadline = time.perf_counter() + next(failure_iter, 1e9)
        proc = subprocess.Popen([sys.executable, __file__, "--child", str(local), "--policy", policy, "--steps",
                                 str(args.steps), "--width", str(args.width)], stdout=subprocess.PIPE, text=True)
        reached = None
        finished = False
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
                last_summary, save_s, finished = ev["summary"], ev["save_s"], True
        proc.wait()
        proc.stdout.close()
        if finished:
            break
        # how far the next run starts: the newest committed checkpoint
        resumed = max(committed_steps(local), default=0) if local.exists() else 0
        if reached is not None:
            lost.append(reached - resumed)
    wall = time.perf_counter() - t0
    shutil.rmtree(local, ignore_errors=True)
    return {"policy": name, "goodput": args.steps / wall, "wall_s": wall, "failures": kills,
            "lost_per_failure": statistics.mean(lost) if lost else 0.0, "summary": last_summary, "save_s": save_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--mtbf", type=float, default=8.0, help="mean seconds between failures")
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
    rng = random.Random(args.seed)
    failures = [rng.expovariate(1 / args.mtbf) for _ in range(50)]
    policies = [("every 10 steps", "EveryNSteps(10)"), ("every 40 steps", "EveryNSteps(40)"),
                ("every 120 steps", "EveryNSteps(120)"), ("continuous", "Continuous()"),
                (f"optimal (mtbf {args.mtbf:g} s)", f"OptimalInterval(mtbf_s={args.mtbf})")]
    state_gb = 4 * (args.width * args.width + args.width) * 4 * 3 / 1e9
    print(f"{args.steps} steps of 4 x Linear({args.width}) + Adam (state {state_gb:.2f} GB); SIGKILL with MTBF "
          f"{args.mtbf:g} s (the same failure times for every policy)")
    rows = [run_policy(name, policy, args, failures, out) for name, policy in policies]
    print("\n| policy | goodput (steps/s) | failures | work lost / failure (steps) | P50 interval | save duration | stalled |")
    print("|---|---:|---:|---:|---:|---:|---:|")

    def secs(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f} s"

    for r in rows:
        s = r["summary"] or {}
        stall = s.get("stall_fraction")
        print(f"| {r['policy']} | {r['goodput']:.2f} | {r['failures']} | {r['lost_per_failure']:.1f} | "
              f"{secs(s.get('interval_p50_s'))} | {secs(r['save_s'])} | {'-' if stall is None else f'{stall:.1%}'} |")
    best_fixed = max(r["goodput"] for r in rows[:3])
    cont = rows[3]
    p50 = (cont["summary"] or {}).get("interval_p50_s")
    ratio = "-" if p50 is None or not cont["save_s"] else f"{p50 / cont['save_s']:.2f}x"
    print(f"\ncontinuous: P50 interval / save duration = {ratio} (bar <= 2x); "
          f"goodput / best fixed = {cont['goodput'] / best_fixed:.2f}x (bar >= 1x)")


if __name__ == "__main__":
    main()
