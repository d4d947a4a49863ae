"""Fault trials shared by the fault-injection tests (a few seeds) and ``benchmarks/fault_sweep.py`` (many).

Each trial injects real faults and returns a :class:`Tally`: faults injected, checkpoints lost
(a committed checkpoint the policies should have kept that no tier can load) and wrong values
loaded (a load that returned anything but what was saved for its step). Both must stay 0.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from persist_core import CheckpointEngine, CheckpointReader, CorruptCheckpointError, KeepLastN, RemoteError
from tests.support.states import assert_state_equal
from tests.support import states

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden"


def state_for(step: int) -> dict[str, Any]:
    return states.state_for(step, (512, 512), random=True, bias=torch.half,
                            optim={"lr": 0.1 / (step + 1), "betas": (0.9, 0.999)})


@dataclass
class Tally:
    faults: int = 0
    lost: int = 0
    wrong: int = 0
    leaks: int = 0  # temporaries that survived a restart
    notes: list[str] = field(default_factory=list)

    def add(self, other: Tally) -> None:
        self.faults += other.faults
        self.lost += other.lost
        self.wrong += other.wrong
        self.leaks += other.leaks
        self.notes += other.notes


def _check_loads(reader: CheckpointReader, tier: str, tally: Tally) -> list[int]:
    steps = [c.step for c in reader.list(tier)]
    for step in steps:
        try:
            assert_state_equal(reader.load(step) if tier == "local" else _remote_load(reader, step), state_for(step))
        except AssertionError as e:
            tally.wrong += 1
            tally.notes.append(f"{tier} step {step} loaded wrong values: {e}")
    return steps


def _remote_load(reader: CheckpointReader, step: int) -> Any:
    return reader.load(step)  # the local copy when there, else the remote one (downloaded, verified)


def kill_trial(work: Path, url: str, options: dict[str, Any] | None, seed: int) -> Tally:
    """SIGKILL a saving, uploading, pruning job at a random moment; restart it and check both tiers."""
    rng = random.Random(seed)
    local, tally = work / "ckpt", Tally(faults=1)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PERSIST_TEST_STORAGE_OPTIONS": json.dumps(options)}
    child = subprocess.Popen([sys.executable, "-m", "tests.support.fault_child", str(local), url, "1"], cwd=ROOT,
                             stdout=subprocess.PIPE, text=True, env=env)
    committed = 0
    try:
        line = child.stdout.readline()
        assert line.startswith("committed "), f"child died early: {line!r}"
        committed = int(line.split()[1])
        for _ in range(rng.randint(0, 4)):  # then a few more commits: retention and uploads are running
            line = child.stdout.readline()
            if line.startswith("committed "):
                committed = int(line.split()[1])
        time.sleep(rng.uniform(0.0, 0.05))  # inside a write, a commit, an upload or a deletion
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait()
        child.stdout.close()
    with CheckpointEngine(local, remote_url=url, storage_options=options, keep_local=KeepLastN(2),
                          keep_remote=KeepLastN(3), remote_timeout_s=60) as engine:
        engine.wait()  # the restarted job uploads what the killed one left un-synced
        leftovers = [p.name for p in local.iterdir() if p.name.startswith(".tmp-")]
        if leftovers:
            tally.leaks += len(leftovers)
            tally.notes.append(f"temporaries left after restart: {leftovers}")
    with CheckpointReader(local, remote_url=url, storage_options=options) as reader:
        local_steps = _check_loads(reader, "local", tally)
        remote_steps = [c.step for c in reader.list("remote")]
        if not local_steps or local_steps[-1] < committed:
            tally.lost += 1
            tally.notes.append(f"step {committed} was committed; local has {local_steps}")
        if local_steps and local_steps[-1] not in remote_steps:
            tally.lost += 1
            tally.notes.append(f"newest local {local_steps[-1]} never reached the remote {remote_steps}")
        for step in remote_steps[-1:]:
            assert_state_equal(reader.load(step), state_for(step))
    return tally


def outage_trial(work: Path, url: str, proxy: Any, seed: int, steps: int = 12) -> Tally:
    """Remote outages and connection resets at random steps while a job saves; nothing may be lost."""
    rng = random.Random(seed)
    # a reset can leave a connection black-holed: the client's read timeout (60 s by default) ends it
    options = {"client_kwargs": {"endpoint_url": proxy.url},
               "config_kwargs": {"retries": {"max_attempts": 1}, "read_timeout": 5, "connect_timeout": 5}}
    tally = Tally()
    engine = CheckpointEngine(work / "ckpt", remote_url=url, storage_options=options, keep_local=KeepLastN(1),
                              remote_timeout_s=30)
    try:
        for step in range(1, steps + 1):
            fault = rng.random()
            if fault < 0.3:
                proxy.outage(True)
                tally.faults += 1
            elif fault < 0.5:
                proxy.outage(False)
                proxy.reset_connections(rng.randint(1, 3), after_bytes=rng.randint(0, 200_000))
                tally.faults += 1
            elif fault < 0.7:
                proxy.outage(False)
            engine.save(state_for(step), step=step)
            if rng.random() < 0.3:
                try:
                    engine.wait(timeout=0.3)
                except (TimeoutError, RemoteError):
                    pass  # the outage: the un-synced steps stay on disk
        proxy.outage(False)
        try:
            engine.wait()
        except RemoteError as e:
            tally.notes.append(f"the remote did not catch up once back: {e}")
    finally:
        proxy.outage(False)
        try:
            engine.close()
        except RemoteError:
            pass  # said above; what is missing on the remote is counted below
    with CheckpointReader(work / "fresh", remote_url=url, storage_options=options) as fresh:
        remote_steps = [c.step for c in fresh.list("remote")]
        missing = sorted(set(range(1, steps + 1)) - set(remote_steps))
        if missing:  # no remote policy: the remote must end up with every checkpoint
            tally.lost += len(missing)
            tally.notes.append(f"never uploaded: {missing}")
        for step in rng.sample(remote_steps, min(3, len(remote_steps))):
            try:
                assert_state_equal(fresh.load(step), state_for(step))
            except AssertionError as e:
                tally.wrong += 1
                tally.notes.append(f"remote step {step}: {e}")
    return tally


def flip_trials(work: Path, bits: list[int]) -> Tally:
    """Flip each of ``bits`` of a version-2 manifest (an older good checkpoint beside it): load must fall back."""
    from tests.support.golden import golden_state

    tally = Tally()
    with CheckpointEngine(work, direct_io="off", chunk_bytes=4096 * 4) as engine:
        engine.save({**golden_state(), "step": 11}, step=11).wait()
    ckpt = work / "step-000000000012"
    ckpt.mkdir()
    (ckpt / "rank-00000.safetensors").write_bytes((GOLDEN / "v2-rank-00000.safetensors").read_bytes())
    good = (GOLDEN / "v2-manifest.json").read_bytes()
    with CheckpointReader(work) as reader:
        for bit in bits:
            raw = bytearray(good)
            raw[bit // 8] ^= 1 << (bit % 8)
            (ckpt / "manifest.json").write_bytes(bytes(raw))
            tally.faults += 1
            try:
                state = reader.load()
            except CorruptCheckpointError as e:
                tally.lost += 1
                tally.notes.append(f"bit {bit}: no fallback ({e})")
                continue
            except Exception as e:  # anything but the library's own error stops a fallback: count it
                tally.lost += 1
                tally.notes.append(f"bit {bit}: {type(e).__name__}: {e}")
                continue
            try:
                assert_state_equal(state, {**golden_state(), "step": 11} if state["step"] == 11 else golden_state())
            except AssertionError as e:
                tally.wrong += 1
                tally.notes.append(f"bit {bit}: {e}")
    return tally
