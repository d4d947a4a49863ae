"""The memory tier through the adapters with two processes (issue 42): a Lightning DDP Trainer and an Accelerate job
snapshot on every rank, every process of the job is SIGKILLed at a known step, and the restart resumes every rank
from the step they all have in memory, bit-exact. Plain ``strategy="ddp"`` (the plugin called on rank 0 only) takes
no snapshots and says so once."""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from lightning_persist import PersistCheckpointIO
from tests.support.moto_server import free_port
from tests.support.states import assert_state_equal

SUPPORT = Path(__file__).parents[1] / "support"
ROOT = Path(__file__).parents[2]


class HeldJob:
    """A job started with ``cmd`` whose ranks each print ``ready <step> <pid>`` and wait: :meth:`kill` SIGKILLs every
    process of it (the ranks and the launcher, by id) and returns once each is gone."""

    def __init__(self, cmd: list[str], ranks: int, log: Path) -> None:
        self.ranks = ranks
        self._log = log
        with open(log, "w") as err:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                         cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})

    def ready(self) -> tuple[int, list[int]]:
        """The step every rank holds at, and the ranks' process ids."""
        said = []
        while len(said) < self.ranks:
            line = self.proc.stdout.readline()
            assert line, f"the job ended before every rank was ready:\n{self._log.read_text()[-3000:]}"
            if line.startswith("ready "):
                said.append([int(w) for w in line.split()[1:]])
        steps = {s for s, _ in said}
        assert len(steps) == 1, said
        return steps.pop(), [pid for _, pid in said]

    def kill(self, pids: list[int]) -> None:
        fds = [os.pidfd_open(pid) for pid in {*pids, self.proc.pid}]  # before the signal: no pid reused meanwhile
        try:
            for fd in fds:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            for fd in fds:  # readable once the process is gone (its locks with it)
                assert select.select([fd], [], [], 60)[0], "a killed process did not end"
        finally:
            for fd in fds:
                os.close(fd)
        assert self.proc.wait(timeout=60) == -signal.SIGKILL
        self.proc.stdin.close()
        self.proc.stdout.close()

    def close(self) -> None:
        """Whatever is left of the job, killed (a failed test)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _records(shm: Path, rank: int) -> dict[int, Path]:
    """Rank ``rank``'s committed snapshot records under ``shm``, by step."""
    return {json.loads(p.read_text())["step"]: p for p in shm.glob(f"*/rank-{rank:05d}/life-*/slot-*.json")}


def _crash_and_restart(held: list[str], resumed: list[str], tmp_path: Path, *, drop_rank1_newest: bool) -> int:
    """Run ``held`` until every rank waits, SIGKILL the job, optionally take rank 1's snapshot of the step it held
    at back (as if the kill came before its record), run ``resumed``; the step both ranks resumed from, checked."""
    job = HeldJob(held, 2, tmp_path / "first.log")
    try:
        step, pids = job.ready()
        job.kill(pids)
    finally:
        job.close()
    shm = tmp_path / "shm"
    for r in (0, 1):  # each rank's own snapshots; the step before the one held at is committed (saved to disk too)
        assert step - 1 in _records(shm, r), (r, sorted(_records(shm, r)))
    if drop_rank1_newest:
        newest = _records(shm, 1).get(step)
        if newest is not None:
            newest.unlink()
    second = subprocess.run(resumed, capture_output=True, text=True, timeout=120, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert second.returncode == 0, second.stderr[-3000:]
    got = [torch.load(tmp_path / f"w.resumed{r}") for r in (0, 1)]
    assert got[0]["step"] == got[1]["step"], "the ranks agree on one step"
    at = got[0]["step"]
    assert at == step - 1 if drop_rank1_newest else at in (step, step - 1)  # at most one step lost
    for r in (0, 1):  # each rank's weights are those of that step, bit for bit
        assert_state_equal(got[r]["weights"], torch.load(tmp_path / f"w.step{at}"))
    assert not list(shm.rglob("slot-*")), "the finished run removed the snapshots"
    return at


def test_lightning_ddp_two_ranks_killed_resume_from_the_step_both_have_in_memory(tmp_path):
    # PersistDDPStrategy, io.autosave(EveryNSteps(4)) and memory_every_n_steps=1: a snapshot every step on each rank
    app = [sys.executable, str(SUPPORT / "lightning_app.py"), "--local-dir", str(tmp_path / "ckpt"), "--devices", "2",
           "--strategy", "persist_ddp", "--memory-dir", str(tmp_path / "shm"), "--autosave-every", "4",
           "--out", str(tmp_path / "w")]
    # rank 1's snapshot of step 5 is taken back: rank 0's latest_path() names 5 (newer than the disk's 4), but both
    # must resume from 4
    at = _crash_and_restart([*app, "--max-steps", "20", "--hold-at", "5"], [*app, "--max-steps", "6", "--resume"],
                            tmp_path, drop_rank1_newest=True)
    assert at == 4


def test_accelerate_two_processes_killed_resume_from_the_newest_step_both_have_in_memory(tmp_path):
    # the disk every 4 steps (EveryNSteps(4)); a snapshot every step, the disk's steps too
    def app(*args: str) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                str(free_port()), str(SUPPORT / "accelerate_app.py"), "--local-dir", str(tmp_path / "ckpt"),
                "--memory-dir", str(tmp_path / "shm"), "--out", str(tmp_path / "w"), *args]

    at = _crash_and_restart(app("--steps", "20", "--hold-at", "5", "--policy", "every4"),
                            app("--steps", "6", "--resume", "--policy", "every4"), tmp_path, drop_rank1_newest=False)
    assert at in (4, 5)


class DDPStrategy:
    """Plain DDP as the autosave sees it: Lightning calls the plugin on rank 0 only (one process stands for two)."""

    def broadcast(self, value, src=0):
        return value

    def reduce_boolean_decision(self, value, all=True):
        return value


def test_plain_ddp_takes_no_snapshots_and_says_once_which_strategy_does(tmp_path, caplog):
    io = PersistCheckpointIO(tmp_path / "ckpt", memory_every_n_steps=1, memory_dir=tmp_path / "shm")
    autosave = io.autosave(None)
    with caplog.at_level(logging.WARNING, logger="lightning_persist.snapshots"):
        for step in (1, 2, 3):
            trainer = SimpleNamespace(global_step=step, world_size=2, is_global_zero=True, received_sigterm=False,
                                      strategy=DDPStrategy())
            autosave.on_train_batch_end(trainer)
    said = [r.getMessage() for r in caplog.records if "PersistDDPStrategy" in r.getMessage()]
    assert len(said) == 1 and "DDPStrategy and 2 processes" in said[0], caplog.text
    assert autosave.snapshot_steps == [] and io._session.engine is None  # rank 1 never opens an engine of rank 0's
    assert not list((tmp_path / "shm").rglob("slot-*"))
