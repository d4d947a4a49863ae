"""A training job that resumes from the newest committed checkpoint and trains until it is killed.

The goodput benchmark starts it as a process, SIGKILLs it at random moments and starts it again; it reports on
stdout, one JSON line an event: ``start`` (the step it resumed from), ``step``, ``steady`` (the engine's counts at
its third step) and ``summary`` (``engine.summary()`` every 10 steps).
"""

from __future__ import annotations

import json
import selectors
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks._common.models import accel_model, cpu_model
from persist_core import CheckpointEngine, CheckpointNotFoundError, KeepLastN, MemoryTier, SavePolicy


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
    if setting == "accel":
        model, opt = accel_model(width, stepped=False)  # fixed gradients: the device's backward, done
    else:
        model, opt, train = cpu_model(width)
    engine = CheckpointEngine(local_dir, save_policy=policy, keep_local=KeepLastN(2), memory=memory)
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


def under_failures(command: list[str], env: dict[str, str], *, local: Path, memory_dir: Path | None,
                   horizon_s: float, failures: list[float], smoke: bool = False) -> dict:
    """Run the job ``command`` (:func:`resumable_job` in a process) for ``horizon_s`` seconds of wall time,
    SIGKILLed at the absolute times ``failures`` (seconds after the job's start: every policy meets exactly the same
    failures) and restarted at once each time; its progress is the newest step it reached by the horizon, the work
    a failure lost is the last step reached less the step the next start resumed from. ``smoke``: the clock starts
    at the first start, however long that took. ``local`` and ``memory_dir`` are emptied before and after."""
    _empty(local, memory_dir)
    t0 = time.perf_counter()
    horizon = t0 + horizon_s
    kills = [t0 + f for f in failures if f < horizon_s]
    waiting = smoke
    if waiting:
        horizon, kills = t0 + 300, []
    lost, restarts, reached, best, first_step, last_step, steady = [], [], 0, None, None, None, None
    killed_at = None  # the step reached when the last kill came: the next start says what it lost
    while True:
        spawned = time.perf_counter()
        if spawned >= horizon:
            break
        deadline = min([k for k in kills if k > spawned] + [horizon])
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        started, start_step = None, None
        while True:
            left = deadline - time.perf_counter()
            if left <= 0:
                proc.send_signal(signal.SIGKILL)
                break
            if not sel.select(timeout=left):
                continue
            line = proc.stdout.readline()
            if not line:
                break
            ev = json.loads(line)
            now = time.perf_counter()
            if ev["event"] == "start":
                started, start_step = now, ev["step"]
                restarts.append(now - spawned)  # importing torch, opening the engine, loading
                if killed_at is not None:
                    lost.append(killed_at - start_step)
                    killed_at = None
                reached = start_step  # where the job stands now: a kill before its first step loses nothing more
                if waiting:  # --smoke: the clock starts now
                    waiting, shift = False, now - t0
                    horizon, kills = t0 + horizon_s + shift, [t0 + f + shift for f in failures if f < horizon_s]
                    deadline = min([k for k in kills if k > now] + [horizon])
            elif ev["event"] == "step":
                reached = ev["step"]
                if first_step is None and reached - (start_step or 0) >= 3:
                    first_step = (now, reached)  # the rate from here: past a fresh process's first save (below)
                last_step = (now, reached)
            elif ev["event"] == "steady" and steady is None:
                steady = ev
            elif ev["event"] == "summary" and (best is None or ev["summary"]["saves"] >= best["summary"]["saves"]):
                best = ev  # the engine's numbers of the longest-running process
        proc.wait()
        proc.stdout.close()
        if started is None:  # killed before it could start: the whole restart was lost
            restarts.append(time.perf_counter() - spawned)
        if deadline < horizon and started is not None:
            killed_at = reached
    if killed_at is not None:  # the horizon fell during a restart: the job stands where that restart would resume
        reached, lost = _resumable(local, memory_dir, killed_at, lost)
    _empty(local, memory_dir)
    # steps per second from the first process's third step on: its first save copied into memory the process
    # had never touched, which on this VM costs up to 15x a copy (the hypervisor backs each page on first
    # touch) and makes the next update wait ~1 s at 1.2 GB; a restart pays that again (it is in the
    # goodput), a long job once (it is not C, the cost of each save, which the calibration reads from this)
    rate = ((last_step[1] - first_step[1]) / (last_step[0] - first_step[0])
            if first_step and last_step and last_step[0] > first_step[0] else None)
    return {"progress": reached, "failures": len(kills), "lost": lost, "restarts": restarts, "summary": best,
            "rate": rate, "steady": steady}


def _empty(*dirs: Path | None) -> None:
    for d in dirs:
        if d is not None:
            shutil.rmtree(d, ignore_errors=True)


def _resumable(local: Path, memory_dir: Path | None, killed_at: int, lost: list[int]) -> tuple[int, list[int]]:
    """The step a restart would resume from (the freshest source: memory, then disk), and ``lost`` with what the
    last failure cost."""
    from persist_core import CheckpointReader

    with CheckpointReader(local, memory=None if memory_dir is None else MemoryTier(memory_dir=memory_dir)) as reader:
        newest = reader.latest()
    step = 0 if newest is None else newest.step
    return step, [*lost, killed_at - step]
