"""Goodput under failures, in two settings: fixed intervals around the Young/Daly optimum against
``Continuous`` and ``OptimalInterval``.

A training job (a 4 x Linear(--width) model) must reach ``--steps`` steps. It is SIGKILLed at random
times — exponential inter-arrival with mean MTBF, the same failure times for every policy — and
restarted, resuming from the newest committed checkpoint, ``engine.maybe_save`` deciding when to save
(``keep_local=KeepLastN(2)``), the optimizer guarded (``engine.guard``: ``save()`` returns after
planning, the copy overlaps the next step, the update waits for it). Settings (``--settings``):

* ``accel`` (accelerator-like, the setting of the Orbax and FastPersist results): each step waits
  ``--step-ms`` of "device time" with the host cores free (a GIL-releasing sleep), then an in-place
  update (SGD with momentum on fixed gradients) mutates the state;
* ``cpu`` (CPU-bound): real forward/backward matmuls and Adam on the host cores.

Per setting: two uninterrupted calibration runs (no saves; saving continuously) measure the step time,
a save's cost to training ``C`` (the wall time saving adds per save, at least its stall plus the fence's
waits) and its duration ``D``; then per MTBF the fixed intervals ``EveryNSteps`` at 0.5x, 1x and 2x the
Young/Daly interval ``sqrt(2 C MTBF)`` (so the best fixed interval tried is a strong one), ``Continuous()``
and ``OptimalInterval(mtbf_s=MTBF)``, each on the same failure sequences. Reported: goodput (steps / wall
time, restarts included), failures, work lost per failure, the P50 interval and its ratio to D, the
stalled fraction and the fence's waits (of the last, uninterrupted run of each job).

Bars (issue 17): accel — continuous's P50 interval <= 2x D and its goodput >= the best fixed interval at
every MTBF; cpu — reported as it is, and OptimalInterval >= 0.95x the best fixed interval.

Usage: ``python benchmarks/bench_goodput.py [--quick] [--steps 300] [--mtbfs 10,30,120] [--seeds 1]
[--width 1536] [--step-ms 80] [--settings accel,cpu] [--dir bench-out]``
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


def child(local_dir: str, policy_text: str, steps: int, width: int, setting: str, step_ms: float) -> None:
    """One training process: resume from the newest checkpoint, train to ``steps``, ``maybe_save`` deciding.

    ``setting="accel"``: each step is device time — the host waits ``step_ms`` (a GIL-releasing sleep, the
    host cores free, as while a GPU computes), then an in-place optimizer update (SGD with momentum on fixed
    gradients) mutates the state. ``"cpu"``: real forward/backward matmuls on the host cores, then Adam.
    Either way the optimizer is guarded (``engine.guard``): ``save()`` returns after planning, the copy runs
    during the next step, and the update waits for it.
    """
    sys.path.insert(0, str(ROOT))
    import torch

    from persist_core import (  # noqa: F401
        CheckpointEngine, CheckpointNotFoundError, Continuous, EveryNSteps, KeepLastN, OptimalInterval)

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
    if setting == "accel":
        opt = torch.optim.SGD(model.parameters(), lr=1e-6, momentum=0.9)
        for p in model.parameters():
            p.grad = torch.randn_like(p)  # fixed gradients: the device's backward, done
    else:
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
    guard = engine.guard(opt)
    print(json.dumps({"event": "start", "step": start}), flush=True)
    x = torch.randn(64, width)
    for step in range(start + 1, steps + 1):
        if setting == "accel":
            time.sleep(step_ms / 1000)
            opt.step()
        else:
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        engine.maybe_save(lambda: {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, step=step)
        print(json.dumps({"event": "step", "step": step}), flush=True)
    guard.remove()
    engine.wait()
    print(json.dumps({"event": "done", "summary": engine.summary(), "fence_s": engine._overlap.fence_s}), flush=True)
    engine.close()


def run_policy(policy: str, args: argparse.Namespace, setting: str, failures: list[float], local: Path) -> dict:
    """One job to ``--steps`` under ``policy``, killed at ``failures`` (seconds after each start)."""
    shutil.rmtree(local, ignore_errors=True)
    t0 = time.perf_counter()
    lost, kills, done = [], 0, None
    failure_iter = iter(failures)
    while done is None:
        deadline = time.perf_counter() + next(failure_iter, 1e9)
        proc = subprocess.Popen([sys.executable, __file__, "--child", str(local), "--policy", policy, "--steps",
                                 str(args.steps), "--width", str(args.width), "--setting", setting,
                                 "--step-ms", str(args.step_ms)], stdout=subprocess.PIPE, text=True)
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
            if not sel.select(timeout=min(left, 3600.0)):
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


def _med(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def calibrate(args: argparse.Namespace, setting: str, out: Path) -> dict:
    """Uninterrupted runs: without saves (the step time), and saving continuously (C and D)."""
    bare = run_policy("EveryNSteps(10**9)", args, setting, [], out / "calibrate-bare")
    cont = run_policy("Continuous()", args, setting, [], out / "calibrate-continuous")
    summary = cont["done"]["summary"]
    stall, save = summary["stall_p50_s"] or 0.0, summary["save_p50_s"] or 0.0
    step_s = bare["wall_s"] / args.steps  # restart included: what a step costs a job
    saves = max(summary["saves"], 1)
    # C, a save's cost to training: the wall time saving adds per save (stall, fence waits, slower steps), at
    # least what the engine measured directly (its stall and the fence's waits); never 0 (the grid needs one)
    cost = max((cont["wall_s"] - bare["wall_s"]) / saves, stall + cont["done"]["fence_s"] / saves, 1e-3)
    return {"step_s": step_s, "C": cost, "D": save, "stall": stall, "saves": summary["saves"],
            "fence_s": cont["done"]["fence_s"]}


def run_setting(setting: str, args: argparse.Namespace, out: Path, mtbfs: list[float]) -> list[str]:
    cal = calibrate(args, setting, out / setting)
    lines = [f"### {setting}: {SETTINGS[setting]}", "",
             f"Calibration (uninterrupted, {args.steps} steps): {cal['step_s'] * 1e3:.0f} ms a step without saves; "
             f"saving continuously ({cal['saves']} saves) costs C = {cal['C'] * 1e3:.0f} ms of training per save "
             f"(the wall time it adds: stall P50 {cal['stall'] * 1e3:.1f} ms, fence waits {cal['fence_s']:.2f} s in "
             f"all, slower steps), a save takes D = {cal['D']:.2f} s from save() to committed.", ""]
    print("\n".join(lines), flush=True)
    for mtbf in mtbfs:
        best = math.sqrt(2 * cal["C"] * mtbf)  # Young/Daly: seconds between saves
        grid = sorted({max(1, round(k * best / cal["step_s"])) for k in (0.5, 1.0, 2.0)})
        policies = [(f"every {n} steps", f"EveryNSteps({n})") for n in grid]
        policies += [("continuous", "Continuous()"), (f"optimal (mtbf {mtbf:g} s)", f"OptimalInterval(mtbf_s={mtbf})")]
        rng = random.Random(args.seed + int(mtbf))
        sequences = [[rng.expovariate(1 / mtbf) for _ in range(500)] for _ in range(args.seeds)]
        runs: dict[str, list[dict]] = {name: [] for name, _ in policies}
        for k, failures in enumerate(sequences):  # interleaved: drift on a shared machine hits every policy alike
            for name, policy in policies:
                r = run_policy(policy, args, setting, failures, out / setting / name.replace(" ", "-"))
                runs[name].append(r)
                print(f"  {setting} mtbf {mtbf:g}: sequence {k}: {name}: {r['wall_s']:.1f} s, {r['failures']} "
                      "failures", flush=True)
        table = [f"MTBF {mtbf:g} s — Young/Daly: sqrt(2 C MTBF) = {best:.2f} s = {best / cal['step_s']:.0f} steps; "
                 f"continuous (a save every D = {cal['D']:.2f} s, at most one a step) is the best interval only when "
                 f"that is <= D: {'yes' if best <= cal['D'] else 'no'}", "",
                 "| policy | goodput (steps/s) | failures | work lost / failure | P50 interval | P50 interval / D "
                 "| stalled | fence waits |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        rows = {}
        for name, _ in policies:
            rs = runs[name]
            lost = [x for r in rs for x in r["lost"]]
            summaries = [r["done"]["summary"] for r in rs]  # engine.summary() of each last, uninterrupted run
            row = {"goodput": args.steps * len(rs) / sum(r["wall_s"] for r in rs),
                   "failures": sum(r["failures"] for r in rs), "lost": statistics.mean(lost) if lost else 0.0,
                   "p50": _med([x["interval_p50_s"] for x in summaries]),
                   "save": _med([x["save_p50_s"] for x in summaries]),
                   "stalled": _med([x["stall_fraction"] for x in summaries]),
                   "fence": _med([r["done"]["fence_s"] for r in rs])}
            rows[name] = row
            ratio = "-" if not row["p50"] or not row["save"] else f"{row['p50'] / row['save']:.2f}x"
            table.append(f"| {name} | {row['goodput']:.2f} | {row['failures']} | {row['lost']:.1f} steps | "
                         f"{'-' if row['p50'] is None else format(row['p50'], '.2f') + ' s'} | {ratio} | "
                         f"{'-' if row['stalled'] is None else format(row['stalled'], '.1%')} | "
                         f"{'-' if row['fence'] is None else format(row['fence'], '.2f') + ' s'} |")
        fixed = max(rows[n]["goodput"] for n, _ in policies[: len(grid)])
        cont, optimal = rows["continuous"], rows[policies[-1][0]]
        p50 = "-" if not cont["p50"] or not cont["save"] else f"{cont['p50'] / cont['save']:.2f}x"
        table += ["", f"continuous: P50 interval / save duration {p50}; goodput / best fixed "
                  f"{cont['goodput'] / fixed:.2f}x; optimal / best fixed {optimal['goodput'] / fixed:.2f}x", ""]
        print("\n".join(table), flush=True)
        lines += table
    return lines


SETTINGS = {"accel": "accelerator-like (each step waits --step-ms of device time with the host cores free, then "
                     "an in-place update)",
            "cpu": "CPU-bound (forward/backward matmuls and Adam on the host cores)"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--mtbfs", default="10,30,120", help="mean seconds between failures, comma-separated")
    parser.add_argument("--seeds", type=int, default=1, help="failure sequences; every policy runs each")
    parser.add_argument("--width", type=int, default=1536)
    parser.add_argument("--step-ms", type=float, default=80.0, help="device time of a step (accel setting)")
    parser.add_argument("--settings", default="accel,cpu")
    parser.add_argument("--quick", action="store_true", help="one MTBF (30 s), 150 steps: a few minutes")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--dir", default="bench-out")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--policy", help=argparse.SUPPRESS)
    parser.add_argument("--setting", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.policy, args.steps, args.width, args.setting, args.step_ms)
        return
    if args.quick:
        args.mtbfs, args.steps = "30", min(args.steps, 150)
    mtbfs = [float(m) for m in args.mtbfs.split(",")]
    out = Path(args.dir).absolute() / "goodput"
    out.mkdir(parents=True, exist_ok=True)
    state_gb = 4 * (args.width * args.width + args.width) * 4 * 3 / 1e9
    lines = [f"{args.steps} steps of 4 x Linear({args.width}) (state with optimizer up to {state_gb:.2f} GB), "
             f"SIGKILL at exponential times, MTBF {args.mtbfs} s, {args.seeds} sequence(s), the same for every policy; "
             "restarts (importing torch, loading) included", ""]
    print(lines[0], flush=True)
    t0 = time.perf_counter()
    for setting in args.settings.split(","):
        lines += run_setting(setting, args, out, mtbfs)
    lines.append(f"(the whole run: {time.perf_counter() - t0:.0f} s)")
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
