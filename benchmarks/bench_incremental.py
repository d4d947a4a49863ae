"""Incremental saves (issue 43): a state whose bytes are mostly frozen, saved every step, with and without
``incremental=True``.

The state: a frozen base (``--base-mb``, default 400 MB of fp32 in 8 matrices) and a small trainable adapter (LoRA-like
A/B pairs, ``--adapter-mb`` of fp32) with its Adam state (``exp_avg``, ``exp_avg_sq``): about 97% of the bytes never
change. Each step changes the adapter and its Adam state in place, then saves and waits for the commit; ``--steps``
(20) saves per run, ``keep_local=KeepLastN(2)``. Reported per run, over the saves after the first: the bytes written per
save (the shard files and the manifest) against the floor (the bytes that changed: the adapter and its Adam state, plus
the manifest), the save's stall and save -> committed time (median), and a load of the last step (bit-exact; the median of 3).
Then the content hash's cost against the copy it follows: xxh3-128 over the staged base against a ``copy_`` of it.

With a remote (a ``file://`` directory, so the numbers are the engine's and the disk's, not a network's; ``--no-remote``
skips it), the same two runs with ``remote_url`` and ``keep_remote=KeepLastN(2)``: per save after the first, the bytes
uploaded (every object of the step's remote prefix, the manifest included) against the floor, the upload time and save
-> durable on the remote (``save()`` until ``wait()`` returns: written, committed, uploaded); then a fresh machine's
restore of the last step from the remote alone (a new ``local_dir``, whole load; bit-exact; the median of 3).

    .venv/bin/python benchmarks/bench_incremental.py [--base-mb 400] [--adapter-mb 4] [--steps 20] [--dir bench-out]

``--smoke``: an 8 MB base, 4 steps, in seconds (CI runs it; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import MB, copy_floor, differences, table  # noqa: E402
from persist_core import CheckpointEngine, CheckpointReader, KeepLastN  # noqa: E402


def make_state(base_mb: float, adapter_mb: float) -> dict:
    """A frozen base of 8 fp32 matrices and LoRA-like adapters with Adam state."""
    g = torch.Generator().manual_seed(0)
    per = int(base_mb * MB) // 4 // 8
    base = {f"base.layer{i}.weight": torch.randn(per, generator=g) for i in range(8)}
    n = max(1, int(adapter_mb * MB) // 4 // 16)
    adapter = {f"lora.{i}.{ab}": torch.randn(n, generator=g) * 0.01 for i in range(8) for ab in ("A", "B")}
    optim = {k: {"exp_avg": torch.zeros_like(v), "exp_avg_sq": torch.zeros_like(v), "step": 0} for k, v in adapter.items()}
    return {"model": {**base, **adapter}, "optim": {"state": optim, "lr": 1e-4}, "step": 0}


def train_step(state: dict, step: int) -> None:
    """One Adam-like update of the adapter, in place (the base is frozen)."""
    g = torch.Generator().manual_seed(step)
    for k, s in state["optim"]["state"].items():
        grad = torch.randn(s["exp_avg"].shape, generator=g)
        s["exp_avg"].mul_(0.9).add_(grad, alpha=0.1)
        s["exp_avg_sq"].mul_(0.999).addcmul_(grad, grad, value=0.001)
        s["step"] = step
        state["model"][k].add_(s["exp_avg"] / (s["exp_avg_sq"].sqrt() + 1e-8), alpha=-1e-4)
    state["step"] = step


def changed_bytes(state: dict) -> int:
    """The bytes a step changes: the adapter and its Adam state."""
    return sum(v.numel() * v.element_size() for k, v in state["model"].items() if k.startswith("lora.")) + sum(
        t.numel() * t.element_size() for s in state["optim"]["state"].values() for t in (s["exp_avg"], s["exp_avg_sq"]))


def written(root: Path, step: int) -> int:
    ckpt = root / f"step-{step:012d}"
    return sum(p.stat().st_size for p in ckpt.iterdir())


def run(args: argparse.Namespace, out: Path, incremental: bool) -> dict:
    state = make_state(args.base_mb, args.adapter_mb)
    root = out / ("incremental" if incremental else "full")
    shutil.rmtree(root, ignore_errors=True)
    sizes, stalls, commits, manifests = [], [], [], []
    with CheckpointEngine(root, incremental=incremental, full_every=args.full_every,
                          keep_local=KeepLastN(2)) as engine:
        for step in range(1, args.steps + 1):
            train_step(state, step)
            handle = engine.save(state, step=step)
            handle.wait()
            sizes.append(written(root, step))
            manifests.append((root / f"step-{step:012d}" / "manifest.json").stat().st_size)
            stalls.append(handle.stats.stall_s)
            commits.append(handle.stats.commit_s)
        kept = sorted(int(p.name.removeprefix("step-")) for p in root.glob("step-*"))
    loads = []
    with CheckpointReader(root) as reader:
        for _ in range(3):  # the median of 3: the first one's fresh tensors fault their pages in (noisy here)
            t0 = time.perf_counter()
            loaded = reader.load(step=args.steps)
            loads.append(time.perf_counter() - t0)
    load_s = statistics.median(loads)
    diff = differences(loaded, state)
    shutil.rmtree(root, ignore_errors=True)
    later = slice(1, None)
    return {"written": statistics.median(sizes[later]), "max_written": max(sizes[later]), "first": sizes[0],
            "manifest": statistics.median(manifests[later]), "stall": statistics.median(stalls[later]),
            "commit": statistics.median(commits[later]), "load": load_s, "exact": diff == "bit-exact", "kept": kept}


def remote_bytes(remote: Path, step: int) -> int:
    return sum(p.stat().st_size for p in (remote / f"step-{step:012d}").iterdir())


def run_remote(args: argparse.Namespace, out: Path, incremental: bool) -> dict:
    """The same saves with a ``file://`` remote: bytes uploaded and upload time per save, save -> durable on the
    remote, and a fresh machine's restore of the last step from the remote."""
    state = make_state(args.base_mb, args.adapter_mb)
    where = out / ("remote-incremental" if incremental else "remote-full")
    shutil.rmtree(where, ignore_errors=True)
    root, remote = where / "local", where / "remote"
    uploaded, upload_s, durable = [], [], []
    with CheckpointEngine(root, incremental=incremental, full_every=args.full_every, keep_local=KeepLastN(2),
                          remote_url=remote.as_uri(), keep_remote=KeepLastN(2)) as engine:
        for step in range(1, args.steps + 1):
            train_step(state, step)
            t0 = time.perf_counter()
            handle = engine.save(state, step=step)
            handle.wait()
            durable.append(time.perf_counter() - t0)
            uploaded.append(remote_bytes(remote, step))
            upload_s.append(handle.stats.upload_s)
    restores, exact = [], True
    for i in range(3):  # each a fresh machine: an empty local_dir
        with CheckpointReader(where / f"fresh-{i}", remote_url=remote.as_uri()) as reader:
            t0 = time.perf_counter()
            loaded = reader.load(step=args.steps)
            restores.append(time.perf_counter() - t0)
            exact = exact and reader.loaded_from_remote and differences(loaded, state) == "bit-exact"
    shutil.rmtree(where, ignore_errors=True)
    later = slice(1, None)
    return {"uploaded": statistics.median(uploaded[later]), "max_uploaded": max(uploaded[later]),
            "first": uploaded[0], "upload": statistics.median(upload_s[later]),
            "durable": statistics.median(durable[later]), "restore": statistics.median(restores), "exact": exact}


def hash_cost(args: argparse.Namespace) -> tuple[float, float, int]:
    """Seconds of xxh3-128 over the base's bytes, and of a ``copy_`` of them into touched memory (medians)."""
    import xxhash

    base = [v for k, v in make_state(args.base_mb, 0.001)["model"].items() if k.startswith("base.")]
    copy_s = copy_floor(base, 3)
    views = [memoryview(t.numpy()).cast("B") for t in base]
    times = []
    for _ in range(4):
        t0 = time.perf_counter()
        for v in views:
            xxhash.xxh3_128_hexdigest(v)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]), copy_s, sum(len(v) for v in views)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-mb", type=float, default=400.0)
    parser.add_argument("--adapter-mb", type=float, default=4.0)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--full-every", type=int, default=10)
    parser.add_argument("--dir", type=Path, default=ROOT / "bench-out")
    parser.add_argument("--no-remote", dest="remote", action="store_false", help="skip the runs with a file:// remote")
    parser.add_argument("--smoke", action="store_true", help="an 8 MB base, 4 steps: a check that it runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.base_mb, args.adapter_mb, args.steps = 8.0, 0.25, 4
    logging.basicConfig(level=logging.WARNING)
    out = args.dir
    out.mkdir(parents=True, exist_ok=True)
    try:
        full = run(args, out, incremental=False)
        inc = run(args, out, incremental=True)
        remote = {on: run_remote(args, out, incremental=on) for on in (False, True)} if args.remote else {}
    finally:
        shutil.rmtree(out, ignore_errors=True)
    hash_s, copy_s, hashed = hash_cost(args)
    state = make_state(args.base_mb, args.adapter_mb)
    floor = changed_bytes(state)
    adam = sum(t.numel() * t.element_size() for s in state["optim"]["state"].values() for t in (s["exp_avg"], s["exp_avg_sq"]))
    total = sum(v.numel() * v.element_size() for v in state["model"].values()) + adam
    lines = [
        f"torch {torch.__version__}, {os.cpu_count()} CPUs; state {total / 1e6:.0f} MB, of which {floor / 1e6:.1f} MB "
        f"change each step ({100 * (1 - floor / total):.1f}% frozen); {args.steps} saves, full_every={args.full_every}, "
        "medians over the saves after the first",
        "",
    ]
    lines += table(
        ["run", "first save (MB)", "written per save (MB)", "/ floor", "stall (ms)", "save→committed (s)",
         "load last (s)", "bit-exact"],
        [[name, f"{r['first'] / 1e6:.1f}", f"{r['written'] / 1e6:.2f} (max {r['max_written'] / 1e6:.1f})",
          f"{r['written'] / (floor + r['manifest']):.2f}x", f"{r['stall'] * 1e3:.0f}", f"{r['commit']:.3f}",
          f"{r['load']:.2f}", "yes" if r["exact"] else "NO"] for name, r in (("incremental off", full),
                                                                             ("incremental=True", inc))]
        + [["floor (changed bytes + manifest)", "", f"{(floor + inc['manifest']) / 1e6:.2f}", "1.00x", "", "", "", ""]],
        align="lrrrrrrl")
    lines += [
        "",
        f"save→committed, incremental / off: {inc['commit'] / full['commit']:.2f}x "
        f"({full['commit'] / inc['commit']:.1f}x faster); kept at the end: off {full['kept']}, incremental {inc['kept']}",
        f"hash: xxh3-128 over {hashed / 1e6:.0f} MB {hash_s * 1e3:.0f} ms ({hashed / hash_s / 1e9:.1f} GB/s) against "
        f"the copy_ of them {copy_s * 1e3:.0f} ms ({hashed / copy_s / 1e9:.1f} GB/s): {hash_s / copy_s:.2f}x the copy",
    ]
    if remote:
        off, on = remote[False], remote[True]
        lines += [
            "",
            "With a file:// remote (keep_remote=KeepLastN(2)), medians over the saves after the first; restore: a fresh "
            "machine's whole load of the last step from the remote (median of 3)",
            "",
        ]
        lines += table(
            ["run", "first upload (MB)", "uploaded per save (MB)", "/ floor", "upload (s)",
             "save→durable on the remote (s)", "fresh-machine restore (s)", "bit-exact"],
            [[name, f"{r['first'] / 1e6:.1f}", f"{r['uploaded'] / 1e6:.2f} (max {r['max_uploaded'] / 1e6:.1f})",
              f"{r['uploaded'] / (floor + inc['manifest']):.2f}x", f"{r['upload']:.3f}", f"{r['durable']:.3f}",
              f"{r['restore']:.2f}", "yes" if r["exact"] else "NO"]
             for name, r in (("remote, incremental off", off), ("remote, incremental=True", on))]
            + [["floor (changed bytes + manifest)", "", f"{(floor + inc['manifest']) / 1e6:.2f}", "1.00x", "", "", "",
                ""]],
            align="lrrrrrrl")
        lines += [
            "",
            f"save→durable on the remote, incremental / off: {on['durable'] / off['durable']:.2f}x "
            f"({off['durable'] / on['durable']:.1f}x faster); upload {off['upload'] / on['upload']:.1f}x faster; "
            f"fresh-machine restore incremental / off: {on['restore'] / off['restore']:.2f}x",
        ]
    print("\n".join(lines))
    return 0 if full["exact"] and inc["exact"] and all(r["exact"] for r in remote.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
