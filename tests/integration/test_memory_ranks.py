"""The memory tier with several ranks (issue 42 b): real gloo ranks as plain processes, SIGKILLed and restarted.

(i) two ranks on one node resume from their own memory, bit-exact, nothing read from the disk; (ii) one rank's
newest slot torn: both resume from the older step every rank has; (iii) a node lost: 4 ranks as 2 nodes (each with
its own ``local_dir`` and ``memory_dir``, so the engine finds two nodes), killed while training, node 1 wiped; its
replacement restores from node 0's partner copies, bit-exact, nothing lost since the last completed partner copy."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.moto_server import free_port

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


class Ranks:
    """``world`` ranks of :mod:`tests.support.memory_ranks_child`, started at once."""

    def __init__(self, base: Path, world: int, nodes: int, steps: int, *more: str) -> None:
        port = free_port()
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.procs = [subprocess.Popen([sys.executable, "-m", "tests.support.memory_ranks_child", str(r), str(world),
                                        str(port), str(base), str(nodes), str(steps), *more], cwd=ROOT, env=env,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                      for r in range(world)]

    def line(self, rank: int, word: str) -> list[str]:
        line = self.procs[rank].stdout.readline()
        assert line.startswith(word + " "), f"rank {rank} said {line!r}, not {word}"
        return line.split()[1:]

    def resumed(self) -> list[tuple[int, str, bool]]:
        said = [self.line(r, "resumed") for r in range(len(self.procs))]
        return [(int(step), source, equal == "True") for step, source, equal in said]

    def ready(self) -> list[int]:
        return [int(self.line(r, "ready")[0]) for r in range(len(self.procs))]

    def kill(self, ranks: list[int] | None = None) -> None:
        for r in range(len(self.procs)) if ranks is None else ranks:
            self.procs[r].send_signal(signal.SIGKILL)
        for r in range(len(self.procs)) if ranks is None else ranks:
            assert self.procs[r].wait(timeout=30) == -signal.SIGKILL
            self.procs[r].stdout.close()
            self.procs[r].stdin.close()

    def exit(self) -> None:
        for p in self.procs:
            assert p.wait(timeout=60) == 0
            p.stdout.close()
            p.stdin.close()


def _run(base: Path, world: int, nodes: int, steps: int) -> tuple[list[tuple[int, str, bool]], list[int]]:
    """Start, resume, take ``steps`` steps, SIGKILL every rank; what each resumed from and where it got to."""
    ranks = Ranks(base, world, nodes, steps)
    try:
        resumed = ranks.resumed()
        ready = ranks.ready()
    finally:
        ranks.kill()
    return resumed, ready


def _resume(base: Path, world: int, nodes: int) -> list[tuple[int, str, bool]]:
    ranks = Ranks(base, world, nodes, 0)
    resumed = ranks.resumed()
    ranks.exit()
    return resumed


def _records(shm: Path, rank_dir: str) -> dict[int, Path]:
    """The committed slot records under ``shm``'s ``rank_dir``, by step."""
    import json

    return {json.loads(p.read_text())["step"]: p for p in shm.glob(f"*/{rank_dir}/life-*/slot-*.json")}


def _tear(record: Path) -> None:
    """A byte of the slot's data changed after its record was written (what a torn fill leaves, or a bad page)."""
    slot = record.with_suffix("")
    with open(slot, "r+b") as f:
        f.seek(8192)
        b = f.read(1)
        f.seek(8192)
        f.write(bytes([b[0] ^ 0xFF]))


def test_two_ranks_killed_resume_from_their_own_memory_bit_exact_and_a_torn_slot_makes_both_take_the_older_step(
        tmp_path):
    resumed, ready = _run(tmp_path, 2, 1, 8)
    assert resumed == [(-1, "none", True)] * 2
    assert ready == [8, 8]
    resumed, ready = _run(tmp_path, 2, 1, 3)  # killed again, after resuming
    assert resumed == [(8, "memory", True)] * 2  # step 8 is on no disk (5 is): from memory, every byte verified
    assert ready == [11, 11]
    records = _records(tmp_path / "node0" / "shm", "rank-00001")
    assert {10, 11} <= set(records)
    _tear(records[11])  # rank 1's step 11 torn; rank 0's is whole
    assert _resume(tmp_path, 2, 1) == [(10, "memory", True)] * 2  # the newest step both have whole


def test_a_node_lost_while_the_partner_copies_run_behind_the_snapshots_resumes_from_the_last_completed_copy(
        tmp_path):
    # no engine.wait() between steps: the copies lag the snapshots, as in training; each rank's own memory keeps only
    # its newest slots, so the ranks must keep the step their partners hold, or node 0 and node 1's copies share none
    ranks = Ranks(tmp_path, 4, 2, 40, "free")
    try:
        assert ranks.resumed() == [(-1, "none", True)] * 4
        assert ranks.ready() == [40] * 4
    finally:
        ranks.kill()
    shm = tmp_path / "node0" / "shm"
    copied = min(max(_records(shm, f"partner-of-rank-{r:05d}"), default=-1) for r in (2, 3))
    assert copied >= 1, "node 0 holds no partner copy of node 1's ranks"
    for r in (0, 1):  # and node 1 held node 0's ranks' (wiped below with it)
        assert _records(tmp_path / "node1" / "shm", f"partner-of-rank-{r:05d}")
    shutil.rmtree(tmp_path / "node1")  # node 1 lost: its host memory and its disk (the disk had steps 35 and 40)
    resumed = _resume(tmp_path, 4, 2)
    # every rank at the newest step whose copy completed for both of node 1's ranks: lost = the steps since
    assert resumed == [(copied, "memory", True)] * 2 + [(copied, "partner", True)] * 2


def test_a_lost_node_whose_newest_partner_copy_does_not_verify_resumes_with_every_rank_at_the_older_copy(tmp_path):
    _run(tmp_path, 4, 2, 8)
    shm = tmp_path / "node0" / "shm"
    held = {r: _records(shm, f"partner-of-rank-{r:05d}") for r in (2, 3)}  # two slots each: the newest, one older
    assert 8 in held[2] and 8 in held[3]
    _tear(held[3][8])
    shutil.rmtree(tmp_path / "node1")
    # the newest step every rank can still get whole: node 0's own memory, rank 2's copies, rank 3's older copy
    common = set(_records(shm, "rank-00000")) & set(_records(shm, "rank-00001")) & set(held[2]) & (set(held[3]) - {8})
    assert common
    older = max(common)
    # rank 3's pulled copy of 8 fails its checksums where it lands: every rank moves to the older step together
    assert _resume(tmp_path, 4, 2) == [(older, "memory", True)] * 2 + [(older, "partner", True)] * 2


def test_dtensor_leaves_on_several_ranks_are_snapshot_per_rank_and_restored_into_sharded_targets(tmp_path):
    import torch

    from tests.support import memory_ranks_child
    from tests.support.ranks import exit_codes

    ckpt = str(tmp_path / "ckpt")
    assert exit_codes(memory_ranks_child.sharded, 2, ckpt, str(tmp_path), "train") == [-signal.SIGKILL] * 2
    assert exit_codes(memory_ranks_child.sharded, 2, ckpt, str(tmp_path), "restore") == [0, 0]
    for r in range(2):
        got = torch.load(tmp_path / f"sharded-rank{r}.pt", weights_only=False)
        assert got["into"] == (3, "memory", True)  # each rank its own part, bit-exact, from its own memory
        assert got["whole"] == (2, "local", True)  # a rank's part is no whole state: the newest whole one is disk's
