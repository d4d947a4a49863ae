"""A training job that resumes from the newest committed checkpoint and trains until it is killed.

The kill-trial benchmarks start it as a process (:func:`command`; ``python -m benchmarks._common.jobs``), SIGKILL
it and start it again (:mod:`benchmarks._common.kills`: ``bench_goodput.py`` at random moments, ``bench_memory.py``
at random steps). It reports on stdout, one JSON line an event: ``start`` (the step it resumed from and ``load_s``,
the seconds from the job's start to resumed), ``step``, ``steady`` (the engine's counts at its third step) and
``summary`` (``engine.summary()`` every 10 steps).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from typing import Any

from benchmarks._common.models import accel_model, cpu_model
from persist_core import (CheckpointEngine, CheckpointNotFoundError, Continuous, EveryNSteps, KeepLastN, MemoryTier,
                          OptimalInterval, SavePolicy)


def command(local_dir: object, policy: str, *, width: int, setting: str, step_ms: float, guard: bool,
            memory_dir: object = None) -> list[str]:
    """The command line of the job in a process of its own (run it with ``cwd`` the repository's root).

    ``policy``: the save policy as Python (``"Continuous()"``, ``"EveryNSteps(7)"``, ``"OptimalInterval(mtbf_s=30)"``),
    or ``"Memory(n)"`` (the memory tier every ``n`` steps in ``memory_dir``, no disk saves), or
    ``"Memory(n)+Continuous()"`` (both)."""
    argv = [sys.executable, "-m", "benchmarks._common.jobs", str(local_dir), "--policy", policy, "--width",
            str(width), "--setting", setting, "--step-ms", str(step_ms), "--guard", str(int(guard))]
    return argv + ([] if memory_dir is None else ["--memory-dir", str(memory_dir)])


def parse_policy(text: str, memory_dir: str | None) -> tuple[SavePolicy | None, MemoryTier | None]:
    """``(the disk's save policy, the memory tier)`` of a :func:`command`'s ``policy``."""
    memory, disk = None, None
    for part in text.split("+"):
        every = re.fullmatch(r"Memory\((\d+)\)", part.strip())
        if every:
            memory = MemoryTier(every_n_steps=int(every.group(1)), memory_dir=memory_dir)
        else:
            disk = eval(part, {"Continuous": Continuous, "EveryNSteps": EveryNSteps,  # noqa: S307 -- our own text
                               "OptimalInterval": OptimalInterval})
    return disk, memory


def resume(engine: CheckpointEngine, model: Any, opt: Any) -> int:
    """Load the newest checkpoint ``engine`` can get into ``model`` and ``opt``; its step (0: none yet)."""
    try:
        state = engine.load()
    except CheckpointNotFoundError:
        return 0
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    return state["step"]


def resumable_job(local_dir: str, policy: SavePolicy | None, width: int, setting: str, step_ms: float,
                  guard: bool = True, memory: MemoryTier | None = None) -> None:
    """Resume from the newest checkpoint and train until killed, ``maybe_save`` deciding (``policy``); prints
    each step, and the engine's summary every 10 steps.

    ``setting="accel"``: each step is device time — the host waits ``step_ms`` (a GIL-releasing sleep, the
    host cores free, as while a GPU computes), then an in-place optimizer update (SGD with momentum on fixed
    gradients) mutates the state. ``"cpu"``: real forward/backward matmuls on the host cores, then Adam.
    With ``guard`` (the accel setting; the cpu one with ``--cpu-guard``) the optimizer is guarded
    (``engine.guard``): ``save()`` returns after planning, the copy runs during the next step, and the update
    waits for it. Without (the cpu setting's default, as the README advises for CPU-bound training):
    ``save()`` copies everything before it returns. ``memory``: the memory tier snapshots at its steps (with
    ``policy=None``: no disk saves) and a restart resumes from the freshest source.
    """
    t0 = time.perf_counter()
    if setting == "accel":
        model, opt = accel_model(width, stepped=False)  # fixed gradients: the device's backward, done
    else:
        model, opt, train = cpu_model(width)
    engine = CheckpointEngine(local_dir, save_policy=policy, keep_local=KeepLastN(2), memory=memory)
    start = resume(engine, model, opt)
    if guard:
        engine.guard(opt)  # for the process's life: the update waits for a save's background copy
    print(json.dumps({"event": "start", "step": start, "load_s": time.perf_counter() - t0}), flush=True)
    step = start
    while True:
        step += 1
        if setting == "accel":
            time.sleep(step_ms / 1000)
            opt.step()
        else:
            train()
        engine.maybe_save(lambda: {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, step=step)
        print(json.dumps({"event": "step", "step": step}), flush=True)
        if step - start == 3:  # where the calibration's rates start (see run_policy): what came before
            steady = engine.summary()
            print(json.dumps({"event": "steady", "saves": steady["saves"], "fence_s": steady["fence_wait_s"]}), flush=True)
        if step % 10 == 0:
            summary = {**engine.summary(), "steps": step - start}
            print(json.dumps({"event": "summary", "summary": summary, "fence_s": summary["fence_wait_s"]}), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A job that resumes and trains until it is killed (see the module).")
    parser.add_argument("local_dir")
    parser.add_argument("--policy", required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--setting", choices=("accel", "cpu"), required=True)
    parser.add_argument("--step-ms", type=float, required=True)
    parser.add_argument("--guard", type=int, default=1)
    parser.add_argument("--memory-dir", default=None)
    args = parser.parse_args(argv)
    policy, memory = parse_policy(args.policy, args.memory_dir)
    resumable_job(args.local_dir, policy, args.width, args.setting, args.step_ms, bool(args.guard), memory=memory)
    return 0


if __name__ == "__main__":
    sys.exit(main())
