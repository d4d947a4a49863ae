"""Goodput under failures, in two settings: fixed intervals around the Young/Daly optimum against
``Continuous`` and ``OptimalInterval``.

A training job (a 4 x Linear model: ``--accel-width`` 3072, ``--width`` 1536 in the cpu setting) runs for ``--horizon`` seconds of wall time. It is SIGKILLed
at exponential random times with mean MTBF — absolute times from the job's start, the same for every
policy, so every policy meets exactly the same failures — and restarted at once, resuming from the newest
committed checkpoint; ``engine.maybe_save`` decides when to save (``keep_local=KeepLastN(2)``), the
optimizer is guarded (``engine.guard``: ``save()`` returns after planning, the copy overlaps the next
step, the update waits for it). Goodput is the step reached at the horizon / the horizon. Settings
(``--settings``):

* ``accel`` (accelerator-like, the setting of the Orbax and FastPersist results): each step waits
  ``--step-ms`` of "device time" with the host cores free (a GIL-releasing sleep), then an in-place
  update (SGD with momentum on fixed gradients) mutates the state;
* ``cpu`` (CPU-bound): real forward/backward matmuls and Adam on the host cores.

Every job runs with glibc's malloc keeping what it frees (``STEADY_MALLOC``; ``--no-steady-malloc`` for
glibc's defaults, under which each CPU-bound process was fast or slow at random for its whole life here).

Per setting: two pairs of uninterrupted calibration jobs (no saves; saving continuously; medians of the
pairs) measure the step time,
a save's cost to training ``C`` (the time saving adds per save, at least its stall plus the fence's
waits), its duration ``D`` and a restart's time; then per MTBF the fixed intervals ``EveryNSteps`` at
0.5x, 1x and 2x the Young/Daly interval ``sqrt(2 C MTBF)`` (so the best fixed interval tried is a strong
one; when all three are shorter than 1.5 D, where fixed intervals queue behind the previous save, also the
first interval >= 1.5 D), ``Continuous()`` and ``OptimalInterval(mtbf_s=MTBF)``, each on the same failure sequences,
interleaved (the order reversed every other sequence). Reported: goodput; goodput with each restart counted at the median restart time (an
interpreter start slower than usual — this machine is shared — given back at the job's own rate: the
policies cannot change how long importing torch takes); Young/Daly's prediction at each policy's own
interval; work lost per failure; the P50 interval and its ratio to D; the stalled fraction and the
slowdown of the steps while a save is written (the engine's meter); the fence's waits; each policy's ratio to the best fixed interval tried (the fixed interval with the best
goodput over the cell's sequences), over the cell and per sequence, and to the fixed interval that was best on
the *other* sequences (the best of three noisy runs is partly the luckiest, so the first ratio reads low).

Also the memory tier (issue 42; ``Memory(n)``): ``MemoryTier(every_n_steps=n)`` with ``n`` from Young/Daly with its
own C (``sqrt(2 C_memory MTBF)``; ``C_memory`` from a third calibration job that snapshots every step) and no disk
saves: every failure here kills a process, whose restart on the same machine resumes from memory.

Bars (issue 17): accel — continuous's P50 interval <= 2x D and its goodput >= the best fixed interval at
every MTBF; cpu — reported as it is, and OptimalInterval >= 0.95x the best fixed interval. Issue 42: the memory tier
>= the best fixed interval at MTBF 10 and 30 s, >= 0.98x at 120 s.

Usage: ``python benchmarks/bench_goodput.py [--quick] [--horizon 20] [--mtbfs 10,30,120] [--seeds 2]
[--width 1536] [--step-ms 80] [--settings accel,cpu] [--policies fixed,continuous,optimal,memory] [--cpu-guard]
[--no-steady-malloc] [--dir bench-out]`` (``--policies fixed,memory``: issue 42's bars alone, two policies fewer a sequence) (the defaults: about 23 minutes
here; ``--quick``: one MTBF, one sequence, about 6; ``--smoke``: the accel setting with a tiny model, jobs of 1.5 s
from their first start, one calibration pair, one fixed interval, MTBF 1.5 s (a kill 0.39 s in, its restart still
importing torch at the horizon, as at MTBF 3 s with 3 s jobs), about half a minute: a check that it runs, its figures
mean nothing)
"""

from __future__ import annotations

import argparse
import math
import os
import random
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import jobs  # noqa: E402
from benchmarks._common.kills import under_failures  # noqa: E402
from benchmarks._common.models import alternate, mean_interval, median  # noqa: E402
from benchmarks._common.tables import table  # noqa: E402

#: glibc's malloc told never to hand freed memory back to the kernel (``--steady-malloc``, the default). With its
#: defaults a CPU-bound job's process lands, at random, in one of two modes for its whole life: tens of MB freed
#: and re-faulted every step (Adam's temporaries, the gradients ``zero_grad`` frees) or not — on this VM a fault
#: is expensive, and steps of the same model took 60 or 105 ms (28,000 minor faults and 80 ms of system time a
#: step against 4,000-8,000 and 16 ms), so back-to-back jobs of one policy differed by more than policies do.
#: With these two settings: 45-61 ms steps, under 60 faults a step, in each of 6 processes.
STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(4 << 30), "MALLOC_TRIM_THRESHOLD_": str(16 << 30)}


def run_policy(policy: str, args: argparse.Namespace, setting: str, failures: list[float], local: Path) -> dict:
    """One job under ``policy`` (``Memory(n)``: the memory tier every n steps, no disk saves) for ``--horizon``
    seconds of wall time, SIGKILLed at the absolute times ``failures`` (:func:`benchmarks._common.kills.
    under_failures`)."""
    memory_dir = Path(args.memory_root) / local.name if policy.startswith("Memory(") else None
    command = jobs.command(local, policy, width=args.accel_width if setting == "accel" else args.width,
                           setting=setting, step_ms=args.step_ms, guard=setting == "accel" or args.cpu_guard,
                           memory_dir=memory_dir)
    env = {**os.environ, **(STEADY_MALLOC if args.steady_malloc else {}), **({"OMP_NUM_THREADS": "1"} if args.smoke else {})}
    return under_failures(command, env, local=local, memory_dir=memory_dir, horizon_s=args.horizon,
                          failures=failures, smoke=args.smoke)


def calibrate(args: argparse.Namespace, setting: str, out: Path) -> dict:
    """Uninterrupted jobs of ``--horizon`` seconds, interleaved twice: without saves (the step time), and
    saving continuously (C and D); medians of the two pairs (a rate difference between two jobs is what C
    is read from, and one pair on this shared machine moves it several-fold)."""
    pairs = [(run_policy("EveryNSteps(10**9)", args, setting, [], out / "calibrate-bare"),
              run_policy("Continuous()", args, setting, [], out / "calibrate-continuous"),
              run_policy("Memory(1)", args, setting, [], out / "calibrate-memory")) for _ in range(args.pairs)]
    if any(cont["summary"] is None or not bare["rate"] or not mem["rate"] for bare, cont, mem in pairs):
        raise SystemExit(f"--horizon {args.horizon:g} s is too short for a calibration ({setting}); give it at "
                         "least 10 s")
    rows = []
    for bare, cont, mem in pairs:
        summary, steady = cont["summary"]["summary"], cont["steady"] or {"saves": 0, "fence_s": 0.0}
        fence_s = cont["summary"]["fence_s"] - steady["fence_s"]  # from the third step on, as the rates
        stall = summary["stall_p50_s"] or 0.0
        saves = max(summary["saves"] - steady["saves"], 1)
        # C, a save's cost to training: the time saving adds per save (stall, fence waits, slower steps), at
        # least what the engine measured directly (its stall and the fence's waits)
        extra = (1 / cont["rate"] - 1 / bare["rate"]) * (summary["steps"] - 3) / saves if summary.get("steps") else 0.0
        rows.append({"step_s": 1 / bare["rate"], "C": max(extra, stall + fence_s / saves, 1e-4), "stall": stall,
                     "D": summary["save_p50_s"] or 0.0, "saves": saves, "fence_s": fence_s,
                     "slowdown": summary.get("write_slowdown"),
                     # the memory tier's C: what a snapshot every step adds to a step
                     "C_memory": max(1 / mem["rate"] - 1 / bare["rate"], 1e-4)})
    cal = {k: median([r[k] for r in rows]) for k in rows[0]}
    return {**cal, "saves": round(cal["saves"]), "C_each": [r["C"] for r in rows],
            "C_memory_each": [r["C_memory"] for r in rows],
            "restart_s": median([x for pair in pairs for r in pair for x in r["restarts"]])}


def _goodput(r: dict, restart_s: float, step_s: float) -> tuple[float, float]:
    """(steps reached / horizon, the same with every restart counted at the median restart time of the cell:
    the time a slower-than-usual interpreter start cost, at this job's own rate, given back)."""
    raw = r["progress"] / r["horizon"]
    excess = sum(r["restarts"]) - restart_s * len(r["restarts"])
    return raw, (r["progress"] + excess / (step_s if not r["rate"] else 1 / r["rate"])) / r["horizon"]


def run_setting(setting: str, args: argparse.Namespace, out: Path, mtbfs: list[float]) -> tuple[list[str], dict]:
    cal = calibrate(args, setting, out / setting)
    guarded_cpu = setting == "cpu" and args.cpu_guard
    lines = [f"### {setting}: {SETTINGS[setting]}" + (" — optimizer guarded (--cpu-guard)" if guarded_cpu else ""), "",
             f"Calibration (uninterrupted, {args.horizon:g} s; rates and counts from each job's third step on, past "
             f"its first save's copy into never-touched memory, a one-time cost each restart pays): "
             f"{cal['step_s'] * 1e3:.0f} ms a step without saves; saving continuously ({cal['saves']} saves) costs C = {cal['C'] * 1e3:.1f} ms of training per save "
             f"(the time it adds per save: stall P50 {cal['stall'] * 1e3:.1f} ms, fence waits {cal['fence_s']:.2f} s "
             f"in all, slower steps), a save takes D = {cal['D']:.3f} s from save() to committed; a restart takes "
             f"{cal['restart_s']:.1f} s (importing torch, loading). C of the two pairs: "
             f"{', '.join(f'{c * 1e3:.1f} ms' for c in cal['C_each'])}; the engine's own meter: steps "
             f"{'-' if cal['slowdown'] is None else format(cal['slowdown'], '.0%')} slower while a save is written. "
             f"A memory-tier snapshot every step costs C = {cal['C_memory'] * 1e3:.1f} ms a step (pairs: "
             f"{', '.join(f'{c * 1e3:.1f} ms' for c in cal['C_memory_each'])}).",
             ""]
    print("\n".join(lines), flush=True)
    verdicts = {}
    for mtbf in mtbfs:
        best = math.sqrt(2 * cal["C"] * mtbf)  # Young/Daly: seconds between saves
        grid = sorted({max(1, round(k * best / cal["step_s"])) for k in ((1.0,) if args.smoke else (0.5, 1.0, 2.0))})
        # where Young/Daly's interval is under D every grid point queues behind the previous save: then the
        # grid also tries the first interval >= 1.5 D (about where continuous itself saves)
        keeps_up = max(1, math.ceil(1.5 * cal["D"] / cal["step_s"]))
        if grid[-1] < keeps_up and not args.smoke:
            grid.append(keeps_up)
        policies = [(f"every {n} steps", f"EveryNSteps({n})") for n in grid]
        if "continuous" in args.policies:
            policies.append(("continuous", "Continuous()"))
        if "optimal" in args.policies:
            policies.append((f"optimal (mtbf {mtbf:g} s)", f"OptimalInterval(mtbf_s={mtbf})"))
        # the memory tier (issue 42), its interval from Young/Daly with its own C; no disk saves (every failure
        # here kills a process, not the machine: a real run adds a rare disk save for that)
        every = max(1, round(math.sqrt(2 * cal["C_memory"] * mtbf) / cal["step_s"]))
        if "memory" in args.policies:
            policies.append((f"memory tier (every {every})", f"Memory({every})"))
        names = {kind: next((n for n, p in policies if p.startswith(prefix)), None) for kind, prefix in
                 (("continuous", "Continuous("), ("optimal", "OptimalInterval("), ("memory", "Memory("))}
        rng = random.Random(args.seed + int(mtbf))
        sequences = []
        for _ in range(args.seeds):  # absolute failure times within the horizon
            times, at = [], 0.0
            while at < args.horizon:
                at += rng.expovariate(1 / mtbf)
                times.append(at)
            sequences.append(times)
        runs: dict[str, list[dict]] = {name: [] for name, _ in policies}
        for k, failures in enumerate(sequences):  # interleaved: drift on a shared machine hits every policy alike
            for name, policy in alternate(policies, k):  # and no policy always runs first
                r = run_policy(policy, args, setting, failures, out / setting / name.replace(" ", "-"))
                r["horizon"] = args.horizon
                runs[name].append(r)
                print(f"  {setting} mtbf {mtbf:g}: sequence {k}: {name}: step {r['progress']}, {r['failures']} "
                      f"failures, restarts {sum(r['restarts']):.1f} s", flush=True)
        restart_s = median([x for rs in runs.values() for r in rs for x in r["restarts"]]) or 0.0
        n_fail = [sum(1 for f in s if f < args.horizon) for s in sequences]
        predicted = {}
        report = [f"MTBF {mtbf:g} s — {sum(n_fail)} failures in {args.seeds} x {args.horizon:g} s (the same for every "
                  f"policy). Young/Daly: sqrt(2 C MTBF) = {best:.2f} s = {best / cal['step_s']:.1f} steps; continuous "
                  f"(a save every D = {cal['D']:.3f} s, at most one a step) is the best interval only when that is "
                  f"<= D: {'yes' if best <= max(cal['D'], cal['step_s']) else 'no'}", ""]
        header = ["policy", "goodput (steps/s)", "restart-normalized", "Young/Daly predicts", "work lost / failure",
                  "P50 interval", "P50 interval / D", "stalled", "slower while writing", "fence waits"]
        cells = []
        rows = {}
        for name, _ in policies:
            rs = runs[name]
            lost = [x for r in rs for x in r["lost"]]
            summaries = [r["summary"]["summary"] for r in rs if r["summary"]]
            goodputs = [_goodput(r, restart_s, cal["step_s"]) for r in rs]
            p50 = median([x["interval_p50_s"] for x in summaries])
            # Young/Daly's expected goodput at this policy's own interval T: a save costs C, a failure T/2 of
            # work plus a restart; the job's first start is part of the horizon too
            nominal = re.fullmatch(r"(EveryNSteps|Memory)\((\d+)\)", dict(policies)[name])
            interval = int(nominal.group(2)) * cal["step_s"] if nominal else p50 or cal["step_s"]
            c = cal["C_memory"] if nominal and nominal.group(1) == "Memory" else cal["C"]
            waste = c / interval + (interval / 2 + restart_s) / mtbf
            predicted[name] = max(0.0, 1 - waste) * max(0.0, 1 - restart_s / args.horizon) / cal["step_s"]  # and the first start
            rows[name] = row = {
                "goodput": statistics.mean(g[0] for g in goodputs), "norm": [g[1] for g in goodputs],
                "lost": statistics.mean(lost) if lost else 0.0, "p50": p50,
                "save": median([x["save_p50_s"] for x in summaries]),
                "stalled": median([x["stall_fraction"] for x in summaries]),
                "slow": median([x.get("write_slowdown") for x in summaries]),
                "fence": median([r["summary"]["fence_s"] for r in rs if r["summary"]])}
            ratio = "-" if not row["p50"] or not row["save"] else f"{row['p50'] / row['save']:.2f}x"
            cells.append([name, f"{row['goodput']:.2f}", f"{statistics.mean(row['norm']):.2f}",
                          f"{predicted[name]:.2f}", f"{row['lost']:.1f} steps",
                          None if row["p50"] is None else f"{row['p50']:.2f} s", ratio,
                          None if row["stalled"] is None else f"{row['stalled']:.1%}",
                          None if row["slow"] is None else f"{row['slow']:.0%}",
                          None if row["fence"] is None else f"{row['fence']:.2f} s"])
        report += table(header, cells)
        fixed_names = [n for n, _ in policies[: len(grid)]]

        # the best fixed interval tried: the one with the best (restart-normalized) goodput over the cell's
        # sequences — not the best on each sequence, which would pit one run against the luckiest of three
        fixed = max(fixed_names, key=lambda f: statistics.mean(rows[f]["norm"]))

        def versus(name: str) -> tuple[float, list[float]]:  # over the cell, and per sequence
            return (statistics.mean(rows[name]["norm"]) / statistics.mean(rows[fixed]["norm"]),
                    [a / b for a, b in zip(rows[name]["norm"], rows[fixed]["norm"])])

        def held_out(name: str) -> float | None:
            """Against the fixed interval that was best on the *other* sequences, per sequence, averaged: the
            best of several noisy fixed runs is partly the luckiest, so the ratio to it is biased low; chosen on
            other sequences, it is not (``None`` with one sequence)."""
            if args.seeds < 2:
                return None
            ratios = []
            for k in range(args.seeds):
                pick = max(fixed_names, key=lambda f: statistics.mean(x for j, x in enumerate(rows[f]["norm"]) if j != k))
                ratios.append(rows[name]["norm"][k] / rows[pick]["norm"][k])
            return statistics.mean(ratios)

        versions = {kind: (versus(name), held_out(name)) for kind, name in names.items() if name is not None}
        c_row = rows.get(names["continuous"] or "")
        p50 = None if not c_row or not c_row["p50"] or not c_row["save"] else c_row["p50"] / c_row["save"]
        verdicts[mtbf] = {"p50_over_d": p50}
        for kind, ((ratio, k), h) in versions.items():
            verdicts[mtbf].update({kind: ratio, f"{kind}_k": k, f"{kind}_held_out": h})
        said = [f"{kind if kind != 'memory' else 'memory tier'} / the best fixed interval ({fixed}) {ratio:.3f}x (per "
                f"sequence {', '.join(f'{x:.3f}' for x in k)}; {mean_interval(k)}"
                + ("" if h is None else f"; against the fixed interval best on the other sequences (no selection "
                                        f"bias) {h:.3f}x") + ")"
                for kind, ((ratio, k), h) in versions.items()]
        report += ["", "goodput, restart-normalized: " + "; ".join(said)
                  + ("" if names["continuous"] is None else
                     f"; continuous: P50 interval / save duration {'-' if p50 is None else format(p50, '.2f') + 'x'}"),
                  ""]
        print("\n".join(report), flush=True)
        lines += report
    return lines, verdicts


SETTINGS = {"accel": "accelerator-like (each step waits --step-ms of device time with the host cores free, then "
                     "an in-place update)",
            "cpu": "CPU-bound (forward/backward matmuls and Adam on the host cores)"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--horizon", type=float, default=20.0, help="seconds of wall time each job runs")
    parser.add_argument("--mtbfs", default="10,30,120", help="mean seconds between failures, comma-separated")
    parser.add_argument("--seeds", type=int, default=2, help="failure sequences; every policy runs each")
    parser.add_argument("--width", type=int, default=1536, help="the model's width in the cpu setting")
    parser.add_argument("--accel-width", type=int, default=3072,
                        help="the model's width in the accel setting (a larger state: a save's duration D then "
                             "exceeds what a save costs training, the regime continuous checkpointing is for)")
    parser.add_argument("--step-ms", type=float, default=80.0, help="device time of a step (accel setting)")
    parser.add_argument("--settings", default="accel,cpu")
    parser.add_argument("--quick", action="store_true", help="one MTBF (30 s), one sequence: a few minutes")
    parser.add_argument("--smoke", action="store_true", help="the accel setting, tiny and short: a check that it runs")
    parser.add_argument("--pairs", type=int, default=2, help="calibration pairs (no saves, continuous)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--policies", default="fixed,continuous,optimal,memory",
                        help="what runs against the fixed intervals (always run): continuous, optimal, memory; "
                             "e.g. fixed,memory for issue 42's bars alone")
    parser.add_argument("--dir", default="bench-out")
    parser.add_argument("--memory-root", default="/dev/shm/torch-persist-goodput",
                        help="a tmpfs for the memory tier's jobs")
    parser.add_argument("--cpu-guard", action=argparse.BooleanOptionalAction, default=False,
                        help="guard the optimizer in the cpu setting, as in the accel one (default: --no-cpu-guard, "
                             "save() copies everything before it returns, which costs this host's CPU-bound steps less "
                             "(bench_cpu_guard.py) and is what the README advises for CPU-bound training)")
    parser.add_argument("--steady-malloc", action=argparse.BooleanOptionalAction, default=True,
                        help="run the jobs with glibc's malloc keeping what it frees (STEADY_MALLOC); "
                             "--no-steady-malloc: glibc's defaults, under which a CPU-bound process's steps are "
                             "fast or slow at random for its whole life on this VM")
    args = parser.parse_args(argv)
    args.policies = [p.strip() for p in args.policies.split(",")]
    unknown = set(args.policies) - {"fixed", "continuous", "optimal", "memory"}
    if unknown:
        parser.error(f"--policies {','.join(args.policies)}: {', '.join(sorted(unknown))} is none of fixed, "
                     "continuous, optimal, memory (e.g. --policies fixed,memory)")
    if args.quick:
        args.mtbfs, args.seeds = "30", 1
    if args.smoke:
        args.mtbfs, args.seeds, args.pairs, args.horizon, args.settings = "1.5", 1, 1, 1.5, "accel"
        args.width, args.accel_width, args.step_ms = 64, 64, 5.0
    mtbfs = [float(m) for m in args.mtbfs.split(",")]
    out = Path(args.dir).absolute() / "goodput"
    out.mkdir(parents=True, exist_ok=True)
    gb = lambda w: 4 * (w * w + w) * 4 * 3 / 1e9  # noqa: E731 -- 4 x Linear(w) and two moments, GB
    lines = [f"Jobs of {args.horizon:g} s training 4 x Linear({args.accel_width}) in the accel setting, "
             f"4 x Linear({args.width}) in the cpu setting (states with optimizer up to {gb(args.accel_width):.2f} "
             f"and {gb(args.width):.2f} GB), SIGKILLed at exponential times (MTBF {args.mtbfs} s, {args.seeds} sequence(s) of "
             "absolute times: every policy meets the same failures) and restarted at once (importing torch, "
             "loading: included)" + ("; glibc's malloc keeps what it frees (STEADY_MALLOC)" if args.steady_malloc
                                      else "; glibc's malloc with its defaults (--no-steady-malloc)"), ""]
    print(lines[0], flush=True)
    t0 = time.perf_counter()
    verdicts = {}
    for setting in args.settings.split(","):
        more, verdicts[setting] = run_setting(setting, args, out, mtbfs)
        lines += more
    lines += ["### Bars (issues 17 and 42)", ""]
    if "accel" in verdicts and "continuous" in args.policies:
        v = verdicts["accel"]
        p50 = [x["p50_over_d"] for x in v.values()]
        lines.append(f"- accel: continuous's P50 interval <= 2x D at every MTBF: "
                     f"{'met' if all(x is not None and x <= 2 for x in p50) else 'not met'} "
                     f"({', '.join('-' if x is None else f'{x:.2f}x' for x in p50)}); its goodput >= the best fixed "
                     f"interval at every MTBF (over each cell): "
                     f"{'met' if all(x['continuous'] >= 1 for x in v.values()) else 'not met'} ("
                     + ", ".join(f"{m:g} s: {x['continuous']:.3f}x" for m, x in v.items()) + ")")
    for setting, v in verdicts.items() if "memory" in args.policies else ():  # issue 42: >= the best fixed
        met = all(x["memory"] >= (0.98 if m >= 120 else 1.0) for m, x in v.items())
        lines.append(f"- {setting}, issue 42: the memory tier (Young/Daly with its own C) >= the best fixed disk "
                     f"interval (0.98x at MTBF >= 120 s): {'met' if met else 'not met'} ("
                     + ", ".join(f"{m:g} s: {x['memory']:.3f}x, per sequence "
                                 + "/".join(f"{k:.3f}" for k in x["memory_k"]) for m, x in v.items()) + ")")
    if "cpu" in verdicts and {"continuous", "optimal"} <= set(args.policies):
        v = verdicts["cpu"]
        lines.append("- cpu: continuous / best fixed " + ", ".join(
            f"{m:g} s: {x['continuous']:.3f}x" for m, x in v.items())
                     + f"; OptimalInterval >= 0.95x the best fixed at every MTBF: "
                     f"{'met' if all(x['optimal'] >= 0.95 for x in v.values()) else 'not met'} ("
                     + ", ".join(f"{m:g} s: {x['optimal']:.3f}x" for m, x in v.items()) + ")")
    for setting, v in verdicts.items():
        kinds = [k for k in ("continuous", "optimal", "memory") if k in args.policies]
        if args.seeds > 1 and kinds:
            lines.append(f"- {setting}, against the fixed interval best on the other sequences (no selection bias): "
                         + "; ".join(f"{k} " + ", ".join(f"{m:g} s: {x[k + '_held_out']:.3f}x" for m, x in v.items())
                                     for k in kinds))
    lines.append(f"\n(the whole run: {time.perf_counter() - t0:.0f} s)")
    print("\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
