"""The kill-trial driver: start a job, SIGKILL it, start it again, and count what each kill lost.

A *job* is one process or several (the ranks of one run). Each prints one JSON line an event on stdout:
``{"event": "start", "step": s, ...}`` once it resumed (``s``: the step it resumed from, 0 for none; whatever else
it says — ``load_s``, the source it read — is kept), then ``{"event": "step", "step": n}`` after each step it
finished; other events are the job's own business and are skipped here (:mod:`benchmarks._common.jobs` is such a
job; ``bench_memory_adapters.py`` and ``bench_node_loss.py`` have their own).

Three ways to kill, one module:

* by step — :func:`kill_series`: ``kills`` SIGKILLs in a row on one machine, each a number of steps after the
  job's start; each restart resumes from what the kill before it left, and a kill lost the newest step any process
  finished minus the step the restart resumed from (``bench_memory.py``, ``bench_memory_adapters.py``,
  ``bench_node_loss.py``). :func:`kill_trial` is one of its runs.
* by the clock — :func:`under_failures`: a job for a fixed horizon of wall time, SIGKILLed at given absolute times
  and restarted at once each time; its progress is the step reached at the horizon (``bench_goodput.py``).
* by what the job leaves — :func:`kill_when_ready`: a process that prints no events (a Lightning run), SIGKILLed a
  given delay after a file it writes first appears; what the kill left is the caller's to check
  (``lightning_kill_trials.py``).

:func:`tmpfs_dir` picks where the killed jobs' memory tier lives (``/dev/shm`` where there is one).
"""

from __future__ import annotations

import json
import selectors
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

#: the processes of one start of a job, or what makes them anew for each start (a fresh port, say)
Commands = Sequence[Sequence[str]] | Callable[[], Sequence[Sequence[str]]]


@dataclass(frozen=True)
class Trial:
    """One start of a job, until its kill."""

    resumed: int  #: the step it resumed from (the lowest any process said)
    last: int  #: the newest step any process finished before the kill
    starts: list[dict[str, Any]]  #: each process's ``start`` event
    started_s: float  #: from the processes' start to every one of them resumed


@dataclass(frozen=True)
class Kill:
    """A kill and the restart after it."""

    killed: Trial
    restart: Trial
    noted: Any = None  #: what ``between`` said after the kill (:func:`kill_series`)

    @property
    def lost(self) -> int:
        return self.killed.last - self.restart.resumed


def kill_trial(commands: Commands, kill_after: int, *, cwd: Path = ROOT, env: dict[str, str] | None = None) -> Trial:
    """Start the job's processes, read each one's ``start``, wait until the first finished ``kill_after`` steps
    past its start (0: kill at once), SIGKILL every process, then read what each said before it died.

    Raises:
        RuntimeError: a process ended before it was killed (its exit code says why; its stderr is the caller's).
    """
    argvs = commands() if callable(commands) else commands
    t0 = time.perf_counter()
    procs = [subprocess.Popen(list(a), stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, cwd=cwd, env=env)
             for a in argvs]
    try:
        starts = [_start(p, i) for i, p in enumerate(procs)]
        started_s = time.perf_counter() - t0
        resumed = min(s["step"] for s in starts)
        last = starts[0]["step"]
        while last < starts[0]["step"] + kill_after:
            event = _event(procs[0])
            if event is None:
                raise RuntimeError(f"the job's process 0 ended before it was killed: exit code {procs[0].wait()}")
            if event.get("event") == "step":
                last = event["step"]
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
    for p in procs:  # what each said before it died: the newest step any finished
        p.wait()
        for line in p.stdout:
            event = _parse(line)
            if event is not None and event.get("event") == "step":
                last = max(last, event["step"])
        p.stdout.close()
    return Trial(resumed=resumed, last=last, starts=starts, started_s=started_s)


def kill_series(commands: Commands, kills: int, kill_after: Callable[[], int], *, cwd: Path = ROOT,
                env: dict[str, str] | None = None, between: Callable[[Trial], Any] | None = None) -> list[Kill]:
    """``kills`` SIGKILLs in a row on one machine: the job starts from whatever is there, is killed
    ``kill_after()`` steps after its start, and starts again, resuming from what the kill left; the last restart
    is killed as soon as it resumed. ``between(killed)`` runs after each kill, before the restart (a node's disk
    wiped, what the kill left looked at); what it returns is the kill's ``noted``."""
    killed = kill_trial(commands, kill_after(), cwd=cwd, env=env)
    series = []
    for i in range(kills):
        noted = between(killed) if between is not None else None
        restart = kill_trial(commands, kill_after() if i < kills - 1 else 0, cwd=cwd, env=env)
        series.append(Kill(killed, restart, noted))
        killed = restart
    return series


def kill_when_ready(argv: Sequence[str], ready: Callable[[], bool], delay_s: float, *, timeout_s: float = 120,
                    cwd: Path = ROOT) -> str | None:
    """Start ``argv`` (its output dropped), wait until ``ready()`` (asked every 50 ms: a script watching a run, not a
    test), then ``delay_s`` more, and SIGKILL it. ``None`` once killed so; else what went wrong (the process ended,
    or was not ready in ``timeout_s``: it is killed all the same)."""
    child = subprocess.Popen(list(argv), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=cwd)
    try:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if child.poll() is not None:
                return f"the run ended (exit code {child.returncode}) before it was ready"
            if time.monotonic() > deadline:
                return f"the run was not ready in {timeout_s:g} s"
            time.sleep(0.05)
        time.sleep(delay_s)
        return None
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()


def tmpfs_dir(given: str | None, name: str, fallback: Path) -> Path:
    """Where the memory tier of the killed jobs lives: ``given``, else ``/dev/shm/<name>``, else (no ``/dev/shm``)
    ``fallback``; made."""
    shm = Path("/dev/shm")
    root = Path(given) if given else (shm / name if shm.is_dir() else fallback)
    root.mkdir(parents=True, exist_ok=True)
    return root


def under_failures(command: list[str], env: dict[str, str], *, local: Path, memory_dir: Path | None,
                   horizon_s: float, failures: list[float], smoke: bool = False) -> dict:
    """Run the job ``command`` (:func:`benchmarks._common.jobs.resumable_job` in a process) for ``horizon_s`` seconds
    of wall time, SIGKILLed at the absolute times ``failures`` (seconds after the job's start: every policy meets
    exactly the same failures) and restarted at once each time; its progress is the newest step it reached by the
    horizon, the work a failure lost is the last step reached less the step the next start resumed from.
    ``smoke``: the clock starts at the first start, however long that took. ``local`` and ``memory_dir`` are
    emptied before and after."""
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
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
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


def _start(proc: subprocess.Popen, i: int) -> dict[str, Any]:
    event = _event(proc)
    if event is None or event.get("event") != "start":
        raise RuntimeError(f"the job's process {i} said {event!r} instead of resuming; exit code {proc.poll()}")
    return event


def _event(proc: subprocess.Popen) -> dict[str, Any] | None:
    """The process's next event (lines that are not JSON, a library's print, are skipped); ``None`` at its end."""
    for line in proc.stdout:
        event = _parse(line)
        if event is not None:
            return event
    return None


def _parse(line: str) -> dict[str, Any] | None:
    try:
        event = json.loads(line)
    except ValueError:
        return None
    return event if isinstance(event, dict) else None


def _empty(*dirs: Path | None) -> None:
    for d in dirs:
        if d is not None:
            shutil.rmtree(d, ignore_errors=True)


def _resumable(local: Path, memory_dir: Path | None, killed_at: int, lost: list[int]) -> tuple[int, list[int]]:
    """The step a restart would resume from (the freshest source: memory, then disk), and ``lost`` with what the
    last failure cost."""
    from persist_core import CheckpointReader, MemoryTier

    with CheckpointReader(local, memory=None if memory_dir is None else MemoryTier(memory_dir=memory_dir)) as reader:
        newest = reader.latest()
    step = 0 if newest is None else newest.step
    return step, [*lost, killed_at - step]
