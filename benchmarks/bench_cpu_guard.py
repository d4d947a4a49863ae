"""In a CPU-bound loop, does the overlap pay? Continuous saving with ``engine.guard(opt)`` against without.

The cpu setting of ``bench_goodput.py`` (4 x Linear(--width) + Adam, forward/backward matmuls on the host
cores) in blocks of --block steps, interleaved in one process (the order reversed every other round): no
saves (the baseline), saving continuously with a guard (``save()`` returns after planning; the parameters
and Adam's state are copied by a background thread while the next forward and backward run, and the update
waits for it), and saving continuously without one (``save()`` copies everything before it returns). Each
block ends with ``engine.wait()``, inside its time. Per kind: the median step, the saves a block, and
C = (step with saves - step without) x steps / saves, medians over the rounds. On a host whose cores the
training's own ops fill, the background copy takes a core from a 2-thread forward/backward (each of its
barriers waits for the thread descheduled), so it can cost more than the copy it hides.

    .venv/bin/python benchmarks/bench_cpu_guard.py [--rounds 12] [--width 1536]

``--smoke``: one round of two steps, a tiny model, in seconds (CI runs it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import cpu_model, nbytes, print_table, training_state  # noqa: E402
from benchmarks._common.blocks import Nothing, Saving, by_kind, cost_per_save, run_blocks  # noqa: E402
from persist_core import CheckpointEngine, Continuous, KeepLastN  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--width", type=int, default=1536)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one round: a check that it runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds, args.block, args.width = 1, 2, 128
        torch.set_num_threads(1)  # tiny ops gain nothing from more; on busy cores OpenMP's waits take 100s of ms
    model, opt, step = cpu_model(args.width)
    step()
    state = lambda: {"model": model.state_dict(), "optim": opt.state_dict()}  # noqa: E731
    kinds = ("no saves", "guarded", "not guarded")
    with tempfile.TemporaryDirectory(prefix="bench-cpu-guard-") as work:
        engines = [CheckpointEngine(Path(work) / str(i), save_policy=Continuous(), keep_local=KeepLastN(2))
                   for i in range(2)]
        beside = {"no saves": Nothing(), "guarded": Saving(engines[0], state, guard=opt),
                  "not guarded": Saving(engines[1], state)}
        # a step: the host's whole step (forward, backward, Adam); each block ends with engine.wait(), inside its time
        runs = run_blocks(beside, rounds=args.rounds, block=args.block, compute=step, update=None, drain_inside=True)
        for engine in engines:
            engine.close()
    results = {k: [(b.step_s, b.done) for b in blocks] for k, blocks in by_kind(runs).items()}
    med = statistics.median
    bare = [r[0] for r in results["no saves"]]
    print(f"CPU-bound steps: 4 x Linear({args.width}) + Adam ({nbytes(training_state(model, opt)) / 1e9:.2f} GB saved), {torch.get_num_threads()} "
          f"intra-op threads, saving continuously, {args.rounds} rounds of {args.block} steps")
    cost, cells = {}, []
    for kind in kinds:
        step_s = med(r[0] for r in results[kind])
        cost[kind] = cost_per_save(runs, kind, "no saves", args.block)
        cells.append([kind, f"{step_s * 1e3:.1f} ms", f"{step_s / med(bare):.3f}x", f"{med(r[1] for r in results[kind]):.1f}",
                      None if cost[kind] is None else f"{cost[kind] * 1e3:.1f} ms"])
    print_table(["", "step", "/ no saves", "saves/block", "C per save"], cells)
    if cost["guarded"] and cost["not guarded"]:
        print(f"C guarded / not guarded: {cost['guarded'] / cost['not guarded']:.2f}x (above 1: on this host the overlap "
              "costs more than the copy it hides)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
