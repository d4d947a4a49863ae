"""What a guarded save stalls training for when the state has many tensors: this checkout against another.

With ``engine.guard(opt)`` the copy runs in the background, so ``save()`` blocks only for taking the state
apart and laying it out (cached: the same structure every save) — work per tensor, which for a model of
many small tensors is the whole stall. The state: --layers blocks of 4 Linear + 2 LayerNorm (6 x --layers
modules, 4 x as many tensors with AdamW's exp_avg, exp_avg_sq and step), guarded; per process --saves
guarded saves, each after an optimizer step, the median stall of the last two thirds. Each round runs one
fresh process per checkout, alternating which goes first; medians over --rounds. The reference measured in
the same processes: the caller's own ``model.state_dict()`` + ``opt.state_dict()`` (what building the state
costs before any save), and the stall per tensor.

    .venv/bin/python benchmarks/bench_plan.py --baseline /path/to/older/checkout [--layers 32] [--rounds 5]

``--smoke``: this checkout alone (unless --baseline), 2 blocks, 3 saves, in this process, in seconds (CI runs it).
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


def child(code: str, layers: int, saves: int, threads: int = 0) -> dict:
    """One process's saves with the checkout at ``code``: the median stall, the state's build, the tensors."""
    sys.path.insert(0, code)
    import torch

    if threads:
        torch.set_num_threads(threads)
    from persist_core import CheckpointEngine, KeepLastN

    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(256, 768), torch.nn.Linear(256, 256), torch.nn.Linear(256, 1024),
                   torch.nn.Linear(1024, 256), torch.nn.LayerNorm(256), torch.nn.LayerNorm(256)]
    model = torch.nn.Sequential(*blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    stalls, builds = [], []
    with tempfile.TemporaryDirectory(prefix="bench-plan-") as work:
        with CheckpointEngine(work, keep_local=KeepLastN(2)) as engine:
            engine.guard(opt)
            for step in range(1, saves + 1):
                t0 = time.perf_counter()
                state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
                t1 = time.perf_counter()
                handle = engine.save(state, step=step)
                stalls.append(time.perf_counter() - t1)
                builds.append(t1 - t0)
                del state
                opt.step()  # waits for the background copy
                handle.wait()
    tensors = len(model.state_dict()) + sum(len(s) for s in opt.state.values())
    keep = saves // 3
    return {"stall_s": statistics.median(stalls[keep:]), "build_s": statistics.median(builds[keep:]),
            "tensors": tensors}


def run(code: str, args: argparse.Namespace) -> dict:
    if args.smoke and code == str(ROOT):  # this checkout in this process: the same code, without a fresh interpreter
        return child(code, args.layers, args.saves, args.threads)
    out = subprocess.run([sys.executable, __file__, "--child", code, "--layers", str(args.layers),
                          "--saves", str(args.saves), "--threads", str(args.threads)], check=True, capture_output=True,
                         text=True)
    return json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", required=False, help="another checkout of torch-persist (e.g. a git worktree)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--saves", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one process: a check that it runs")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.layers, args.saves, args.rounds, args.threads = 2, 3, 1, 1
    if args.child:
        print(json.dumps(child(args.child, args.layers, args.saves, args.threads)), flush=True)
        return 0
    codes = {"this checkout": str(ROOT)}
    if args.baseline:
        codes["baseline"] = str(Path(args.baseline).resolve())
    results: dict[str, list[dict]] = {k: [] for k in codes}
    for r in range(args.rounds):
        for name in (list(codes) if r % 2 == 0 else list(reversed(codes))):
            results[name].append(run(codes[name], args))
    tensors = results["this checkout"][0]["tensors"]
    print(f"A guarded save of {tensors} tensors ({args.layers} blocks, AdamW), median of the last "
          f"{args.saves - args.saves // 3} of {args.saves} saves per process, medians of {args.rounds} processes each")
    sys.path.insert(0, str(ROOT))
    from benchmarks._common.tables import print_table

    base, cells = None, []
    for name, rows in results.items():
        stall = statistics.median(x["stall_s"] for x in rows)
        build = statistics.median(x["build_s"] for x in rows)
        cells.append([name, f"{stall * 1e3:.2f}", f"{stall / tensors * 1e6:.2f}", f"{build * 1e3:.2f}",
                      f"{stall / build:.2f}"])
        base = stall if name == "baseline" else base
    print_table(["code", "stall (ms)", "us/tensor", "state_dict() (ms)", "stall / state_dict()"], cells)
    if base:
        mine = statistics.median(x["stall_s"] for x in results["this checkout"])
        print(f"this checkout / baseline: {mine / base:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
