"""The README's demo: train, get killed with SIGKILL mid-run, resume, and resume on a fresh machine.

Runs the same small training job (a plain PyTorch loop, CPU is fine) several times:

1. a run that saves every few steps with ``CheckpointEngine`` to a local directory, synced to a
   remote (a ``file://`` URL standing in for ``s3://``), and is SIGKILLed while a save is still
   being written;
2. a restart on the same directory that resumes from the newest committed checkpoint;
3. a "fresh machine" with an empty local directory that resumes from the remote alone;
4. an uninterrupted reference run, to show the resumed run ends bit-identical.

Usage: ``python examples/demo.py`` (``make demo``). Everything lands in ``demo-out/``.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from persist_core import (  # noqa: E402
    AnyOf, CheckpointEngine, CheckpointNotFoundError, CheckpointReader, EveryNSteps, KeepEveryNSteps, KeepLastN)
from persist_core.history import describe_summary  # noqa: E402

TOTAL_STEPS, SAVE_EVERY, KILL_AFTER_SAVE_AT = 60, 5, 35


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10)
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def digest(model: torch.nn.Module) -> str:
    """A fingerprint of the exact bytes of every parameter."""
    import hashlib

    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(64, 512, generator=g), torch.randint(0, 10, (64,), generator=g)


def train(ckpt: Path, remote: str, save: bool) -> None:
    """The training job (a child process); prints one JSON line per event."""
    torch.set_num_threads(1)
    model, opt = build()
    engine = CheckpointEngine(ckpt, remote_url=remote or None, save_policy=EveryNSteps(SAVE_EVERY),
                              keep_local=KeepLastN(2) if remote else None,
                              keep_remote=AnyOf(KeepLastN(3), KeepEveryNSteps(20)) if remote else None)
    start = 0
    try:
        state = engine.load()
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        start = state["step"]
        print(json.dumps({"event": "resumed", "step": start}), flush=True)
    except CheckpointNotFoundError:
        print(json.dumps({"event": "fresh"}), flush=True)
    for step in range(start + 1, TOTAL_STEPS + 1):
        x, y = batch(step)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        handle = engine.maybe_save(lambda: {"model": model.state_dict(), "optim": opt.state_dict(), "step": step,
                                            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}},
                                   step=step) if save else None
        if handle is not None:
            stats = handle.stats
            print(json.dumps({"event": "saved", "step": step, "loss": loss.item(), "stall_ms": stats.stall_s * 1e3,
                              "wait_ms": stats.wait_s * 1e3, "mb": stats.nbytes / 1e6}), flush=True)
    engine.wait()
    summary = describe_summary(engine.summary()) if save else None
    engine.close()
    print(json.dumps({"event": "done", "step": TOTAL_STEPS, "loss": loss.item(), "digest": digest(model),
                      "summary": summary}), flush=True)


def run_child(ckpt: Path, remote: str, save: bool, kill_after_save_at: int | None = None) -> list[dict]:
    cmd = [sys.executable, __file__, "--child", str(ckpt), "--remote", remote] + ([] if save else ["--no-save"])
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    events = []
    for line in child.stdout:
        ev = json.loads(line)
        events.append(ev)
        if ev["event"] == "saved" and ev["step"] == kill_after_save_at:
            child.send_signal(signal.SIGKILL)  # its write of this step is still in flight
            break
    child.wait()
    child.stdout.close()
    events.append({"event": "exit", "code": child.returncode})
    return events


def show(events: list[dict]) -> None:
    for ev in events:
        if ev["event"] == "fresh":
            print("  no checkpoint found: starting at step 0")
        elif ev["event"] == "resumed":
            print(f"  resumed from the newest committed checkpoint: step {ev['step']}")
        elif ev["event"] == "saved":
            print(f"  step {ev['step']:3d}  loss {ev['loss']:.4f}  save(): training stalled {ev['stall_ms']:6.1f} ms "
                  f"(of which waiting for the previous write {ev['wait_ms']:.1f} ms), {ev['mb']:.0f} MB")
        elif ev["event"] == "done":
            print(f"  finished step {ev['step']}  loss {ev['loss']:.4f}")
            if ev["summary"]:
                print(f"  engine.summary(): {ev['summary']}")
        elif ev["event"] == "exit" and ev["code"] == -signal.SIGKILL:
            print("  >>> killed with SIGKILL")


def tiers(ckpt: Path, remote: str, peek: Path) -> str:
    """What each tier holds, read with CheckpointReader (it takes no writer lock: the job may still hold one)."""
    with CheckpointReader(ckpt) as local, CheckpointReader(peek, remote_url=remote) as far:
        return f"local {[i.step for i in local.list()]}, remote {[i.step for i in far.list('remote')]}"


def main() -> None:
    out = ROOT / "demo-out"
    shutil.rmtree(out, ignore_errors=True)
    ckpt, remote = out / "ckpt", (out / "remote").as_uri()
    print(f"== run 1: train {TOTAL_STEPS} steps, checkpoint every {SAVE_EVERY} into {ckpt} (keep 2), synced to "
          f"{remote} (keep 3 + every 20th); SIGKILL right after save(step={KILL_AFTER_SAVE_AT}) returns")
    show(run_child(ckpt, remote, save=True, kill_after_save_at=KILL_AFTER_SAVE_AT))
    print(f"== after the kill: {tiers(ckpt, remote, out / 'peek')}")
    print("== run 2: the same command again")
    t0 = time.perf_counter()
    resumed = run_child(ckpt, remote, save=True)
    show(resumed)
    print(f"== after run 2 ({time.perf_counter() - t0:.1f} s): {tiers(ckpt, remote, out / 'peek')}")
    print("== run 3: a fresh machine (empty local directory), same remote: engine.load() alone")
    fresh = CheckpointEngine(out / "fresh-machine", remote_url=remote)
    state = fresh.load()
    fresh.close()
    model, _ = build()
    model.load_state_dict(state["model"])
    fresh_digest = digest(model)
    print(f"  downloaded and verified step {state['step']} from the remote")
    print("== run 4: an uninterrupted reference run without checkpoints")
    reference = run_child(out / "reference", "", save=False)
    show(reference)
    a, b = resumed[-2], reference[-2]
    same = a["event"] == b["event"] == "done" and a["digest"] == b["digest"] == fresh_digest and a["loss"] == b["loss"]
    stalls = sorted(e["stall_ms"] - e["wait_ms"] for e in resumed if e["event"] == "saved")
    print(f"== resumed run and fresh-machine restore end bit-identical to the uninterrupted run: {same}")
    if stalls:
        print(f"== training stalled {stalls[len(stalls) // 2]:.1f} ms per save (median; the staging copy only)")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--no-save", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--remote", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        train(args.child, args.remote, save=not args.no_save)
    else:
        main()
