"""A restarted job's first saves: with the staging buffer warmed after the load (the default) against without.

A preemptible job restarts in a fresh process: it loads the newest checkpoint, then trains and saves. The
first save's copy goes into a staging buffer nobody has touched, so it also faults in every page of it
(here 2.7x a copy into a reused buffer; in a fresh process of a VM up to 20x, the hypervisor backing the
memory on first touch), and with ``engine.guard(opt)`` the next update waits for that copy. Since the
load says how large the next saves are, the engine allocates the buffer and faults its pages in on a
background thread during the load (``StagingPool.warm``); this benchmark measures what that changes.

After one discarded process (the first after the setup pays the VM's backing of fresh memory, whichever
variant it runs), each round starts two fresh processes, in alternating order: ``warm`` (the engine as it is) and ``cold``
(``StagingPool.warm`` switched off: the behaviour before it). Each one loads the checkpoint of the
accelerator-like job of the goodput benchmark (4 x Linear(--width) and SGD-with-momentum state; the host
waits --step-ms of "device time", then updates in place), then takes --steps steps, saving after each
(guarded). Per process: the load's time, the first save's background copy, and what the updates waited for
copies (the fence) over the steps, the time from the load's start to the last update (whatever the
warm-up takes from the load shows there); the copy floor, measured in the same process: a plain copy of the state
into memory already touched. Medians over --rounds rounds.

    .venv/bin/python benchmarks/bench_restart.py [--width 6144] [--step-ms 400] [--steps 3] [--rounds 3]

``--smoke``: a tiny model, one round, every job in this process (so nothing is fresh), in seconds (CI runs it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common.models import alternate  # noqa: E402
from benchmarks._common.tables import print_table  # noqa: E402


def child(work: str, width: int, step_ms: float, steps: int, variant: str) -> dict:
    """One restarted job: what it measured (nothing for the ``setup`` variant)."""
    sys.path.insert(0, str(ROOT))

    from benchmarks._common import accel_model
    from persist_core import CheckpointEngine, KeepLastN
    from persist_core.staging.pool import StagingPool

    model, opt = accel_model(width, stepped=False)
    if variant == "setup":
        opt.step()
        with CheckpointEngine(work, keep_local=KeepLastN(2)) as engine:
            engine.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 1}, step=1)
        return {}
    warm = StagingPool.warm
    if variant == "cold":
        StagingPool.warm = lambda self, nbytes: None  # the behaviour before the warm-up
    try:
        return _restarted(work, model, opt, step_ms, steps, variant)
    finally:
        StagingPool.warm = warm


def _restarted(work: str, model, opt, step_ms: float, steps: int, variant: str) -> dict:
    import torch

    from benchmarks._common import copy_floor
    from persist_core import CheckpointEngine, KeepLastN

    engine = CheckpointEngine(work, keep_local=KeepLastN(2))
    t0 = time.perf_counter()
    state = engine.load()
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    load_s = time.perf_counter() - t0
    start = state["step"]
    del state
    engine.guard(opt)
    handles, fence0 = [], engine.summary()["fence_wait_s"]
    for step in range(start + 1, start + 1 + steps):
        time.sleep(step_ms / 1000)
        opt.step()  # the guard's fence: waits for the previous save's background copy
        handles.append(engine.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, step=step))
    time.sleep(step_ms / 1000)
    opt.step()
    fence_s = engine.summary()["fence_wait_s"] - fence0
    total_s = time.perf_counter() - t0
    engine.close()
    nbytes = handles[0].stats.nbytes
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]
                     + [s["momentum_buffer"].reshape(-1) for s in opt.state.values()])
    floor_s = copy_floor([flat], 1, warmup=1)  # into memory touched once
    return {"variant": variant, "load_s": load_s, "first_copy_s": handles[0].stats.staging_s, "fence_s": fence_s,
            "total_s": total_s, "floor_s": floor_s, "nbytes": nbytes}


def run(work: str, args: argparse.Namespace, variant: str) -> dict:
    if args.smoke:  # in this process: the same code, without a fresh interpreter (nor its untouched memory)
        return child(work, args.width, args.step_ms, args.steps, variant)
    out = subprocess.run([sys.executable, __file__, "--child", work, "--variant", variant, "--width", str(args.width),
                          "--step-ms", str(args.step_ms), "--steps", str(args.steps)], check=True, capture_output=True,
                         text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=6144)
    parser.add_argument("--step-ms", type=float, default=400.0)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one round: a check that it runs")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="warm", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.width, args.step_ms, args.steps, args.rounds = 256, 5.0, 2, 1
        import torch

        torch.set_num_threads(1)  # tiny ops gain nothing from more; on busy cores OpenMP's waits take 100s of ms
    if args.child:
        print(json.dumps(child(args.child, args.width, args.step_ms, args.steps, args.variant)), flush=True)
        return 0
    results: dict[str, list[dict]] = {"warm": [], "cold": []}
    with tempfile.TemporaryDirectory(prefix="bench-restart-") as work:
        run(work, args, "setup")
        if not args.smoke:  # discarded: the first process after the setup pays the VM's first touch either way
            run(work, args, "cold")
        for r in range(args.rounds):
            for variant in alternate(("warm", "cold"), r):
                results[variant].append(run(work, args, variant))
                print(f"round {r + 1} {variant}: {json.dumps(results[variant][-1])}", flush=True)

    def med(variant: str, key: str) -> float:
        return statistics.median(x[key] for x in results[variant])

    gb = results["warm"][0]["nbytes"] / 1e9
    print(f"\nA restarted job: load a {gb:.2f} GB checkpoint, then {args.steps} guarded saves, one per "
          f"{args.step_ms:g} ms step (medians of {args.rounds} rounds, fresh processes, alternating)")
    labels = (("load_s", "load + load_state_dict (s)"), ("first_copy_s", "first save's copy (s)"),
              ("fence_s", f"updates waited, {args.steps} steps (s)"), ("total_s", "load to the last update (s)"))
    print_table(["", "warm (default)", "cold (before)", "warm / cold"],
                [[label, f"{med('warm', key):.3f}", f"{med('cold', key):.3f}",
                  f"{med('warm', key) / med('cold', key):.2f}" if med("cold", key) else None] for key, label in labels])
    floor = statistics.median(x["floor_s"] for v in results.values() for x in v)
    print(f"copy floor (a copy into touched memory): {floor:.3f} s; first save's copy / floor: warm "
          f"{med('warm', 'first_copy_s') / floor:.2f}x, cold {med('cold', 'first_copy_s') / floor:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
