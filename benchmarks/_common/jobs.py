"""A training job that resumes from the newest committed checkpoint and trains until it is killed.

The goodput benchmark starts it as a process, SIGKILLs it at random moments and starts it again; it reports on
stdout, one JSON line an event: ``start`` (the step it resumed from), ``step``, ``steady`` (the engine's counts at
its third step) and ``summary`` (``engine.summary()`` every 10 steps).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks._common.models import accel_model, cpu_model
from persist_core import CheckpointEngine, CheckpointNotFoundError, KeepLastN, SavePolicy


def resume(engine: CheckpointEngine, model: Any, opt: Any) -> int:
    """Load the newest checkpoint ``engine`` can get into ``model`` and ``opt``; its step (0: none yet)."""
    try:
        state = engine.load()
    except CheckpointNotFoundError:
        return 0
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    return state["step"]


def resumable_job(local_dir: str, policy: SavePolicy, width: int, setting: str, step_ms: float,
                  guard: bool = True) -> None:
    """Resume from the newest checkpoint and train until killed, ``maybe_save`` deciding (``policy``); prints
    each step, and the engine's summary every 10 steps.

    ``setting="accel"``: each step is device time — the host waits ``step_ms`` (a GIL-releasing sleep, the
    host cores free, as while a GPU computes), then an in-place optimizer update (SGD with momentum on fixed
    gradients) mutates the state. ``"cpu"``: real forward/backward matmuls on the host cores, then Adam.
    With ``guard`` (the accel setting; the cpu one with ``--cpu-guard``) the optimizer is guarded
    (``engine.guard``): ``save()`` returns after planning, the copy runs during the next step, and the update
    waits for it. Without (the cpu setting's default, as the README advises for CPU-bound training):
    ``save()`` copies everything before it returns.
    """
    if setting == "accel":
        model, opt = accel_model(width, stepped=False)  # fixed gradients: the device's backward, done
    else:
        model, opt, train = cpu_model(width)
    engine = CheckpointEngine(local_dir, save_policy=policy, keep_local=KeepLastN(2))
    start = resume(engine, model, opt)
    if guard:
        engine.guard(opt)  # for the process's life: the update waits for a save's background copy
    print(json.dumps({"event": "start", "step": start}), flush=True)
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


def kill_trial(command: list[str], kill_after: int, *, cwd: Path) -> dict:
    """Run a job that prints one JSON line per event (``start`` with the ``step`` it resumed from, and
    ``load_s``; then ``step`` after each step) until ``kill_after`` steps past its start finished, then SIGKILL
    it; what it resumed from, the last step it finished, and how long its start took."""
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=cwd)
    try:
        start = json.loads(child.stdout.readline())
        last = start["step"]
        while last < start["step"] + kill_after:
            line = child.stdout.readline()
            if not line:
                raise RuntimeError("the job died before it was killed")
            event = json.loads(line)
            last = event.get("step", last) if event.get("event") == "step" else last
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait()
        child.stdout.close()
    return {"resumed": start["step"], "last": last, "load_s": start.get("load_s", 0.0)}
