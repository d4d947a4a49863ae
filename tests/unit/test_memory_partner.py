"""Partner copies (issue 42 b, ``persist_core.memory.partner``) between two ranks joined by an in-process channel: who
partners whom, a copy whole or ignored, the copy steps every rank agrees on (a new one only once every rank finished
the last), the settled copy kept by the rank that holds it."""

from __future__ import annotations

import collections
import queue
import shutil
import threading
from pathlib import Path

import pytest

from persist_core import CheckpointEngine, MemoryTier
from persist_core.memory import MemoryStore, PartnerCopies, Snapshot, partners
from tests.support.states import state_for


class Wire:
    """Byte messages between ranks of one process (what gloo's send/recv are to the partner copies)."""

    def __init__(self) -> None:
        self.queues: dict[tuple[int, int, int], queue.Queue] = collections.defaultdict(queue.Queue)
        self._lock = threading.Lock()

    def end(self, rank: int) -> End:
        return End(self, rank)

    def queue(self, key: tuple[int, int, int]) -> queue.Queue:
        """The queue of ``key``, made once: the sending and the receiving thread may ask for it first at the same
        moment (a defaultdict's factory runs Python code, so two threads could each make one and a message went
        into the queue nobody read)."""
        with self._lock:
            return self.queues[key]


class End:
    def __init__(self, wire: Wire, rank: int) -> None:
        self.wire, self.rank = wire, rank
        self.sent = 0
        self.hold_at: int | None = None  # the send that waits for `release` (after setting `held`)
        self.held, self.release = threading.Event(), threading.Event()

    def send(self, data, peer: int, tag: int) -> None:
        self.sent += 1
        if self.sent == self.hold_at:
            self.held.set()
            assert self.release.wait(30)
        self.wire.queue((self.rank, peer, tag)).put(bytes(data))

    def recv_into(self, buf, peer: int, tag: int) -> None:
        data = self.wire.queue((peer, self.rank, tag)).get(timeout=30)
        assert len(data) == len(buf)
        memoryview(buf)[:] = data


@pytest.mark.parametrize("groups, rank, expected", [
    (((0, 1), (2, 3)), 0, (2, 2)), (((0, 1), (2, 3)), 3, (1, 1)),
    (((0, 1), (2, 3), (4, 5)), 1, (3, 5)), (((0, 1), (2, 3), (4, 5)), 4, (0, 2)),
    (((0, 1, 2, 3),), 2, (None, None)),  # one node: no partner
    (((0, 1), (2,)), 1, (None, None)), (((0, 1), (2,)), 2, (0, 0)),  # a node with fewer ranks
])
def test_the_partner_is_the_same_local_rank_on_the_next_node(groups, rank, expected):
    assert partners(groups, rank) == expected


class Everyone:
    """The training thread's channel of ranks that live in this process: an all-gather is each one's vote, as each
    would say it (``extra``: the votes of ranks that are not here)."""

    def __init__(self, extra: list[tuple[int, int]] = ()) -> None:
        self.ranks: list[PartnerCopies] = []
        self.extra = list(extra)

    def all_gather(self, mine):
        return [r.vote() for r in self.ranks] + self.extra


def _pair(wire: Wire, held: MemoryStore, *, ranks: tuple[int, int] = (0, 1)) -> tuple[Everyone, PartnerCopies, PartnerCopies]:
    """Rank ``ranks[0]`` sending its copies to ``ranks[1]``, which holds them in ``held``; their channel."""
    channel = Everyone()
    a, b = ranks
    sender = PartnerCopies(wire.end(a), channel, rank=a, partner=b, source=None, held=None,
                           chunk_bytes=64 << 10)
    receiver = PartnerCopies(wire.end(b), channel, rank=b, partner=None, source=a, held=held, chunk_bytes=64 << 10)
    channel.ranks += [sender, receiver]
    return channel, sender, receiver


def _three(tmp_path: Path) -> list[Snapshot]:
    """Committed snapshots of steps 1, 2 and 3 (an engine's memory tier keeps its newest two)."""
    return _snapshots(tmp_path / "a") + _snapshots(tmp_path / "b", (2, 3))[1:]


def _snapshots(tmp_path: Path, steps: tuple[int, int] = (1, 2)) -> list[Snapshot]:
    """Committed snapshots of ``steps`` (1 MiB each) left in ``tmp_path/shm`` by an engine."""
    memory = MemoryTier(memory_dir=tmp_path / "shm")
    engine = CheckpointEngine(tmp_path / "ckpt", memory=memory)
    for step in steps:
        engine.snapshot(state_for(step, (512, 512), random=True), step)
    engine.wait()
    engine._close(finished=False)
    snaps = sorted(MemoryStore(next((tmp_path / "shm").iterdir()) / "rank-00000", identity=None).snapshots(),
                   key=lambda s: s.step)
    assert [s.step for s in snaps] == list(steps)
    return snaps


def _torn(snap: Snapshot, path: Path) -> Snapshot:
    """``snap`` with a byte of its image changed after its record was written."""
    shutil.copyfile(snap.path, path)
    with open(path, "r+b") as f:
        f.seek(100_000)
        b = f.read(1)
        f.seek(100_000)
        f.write(bytes([b[0] ^ 0xFF]))
    return Snapshot(snap.manifest, path)


def test_a_new_copy_step_waits_until_every_rank_finished_the_last_and_a_copy_that_does_not_verify_is_not_kept(
        tmp_path):
    one, two, three = _three(tmp_path)
    wire = Wire()
    held = MemoryStore(tmp_path / "node1" / "partner-of-rank-00000", identity="nodes-0-1")
    channel, sender, receiver = _pair(wire, held)
    sending = sender._p2p
    try:
        assert sender.agree(1) and receiver.agree(1)  # the first snapshot step is a copy step on every rank
        receiver.offer(one)  # the receiving rank's own snapshot of it (it has no partner: nothing to send)
        sending.hold_at = 6  # BEGIN, record, then chunk 1 and 2 (a header and its bytes each): the copy is in flight
        sender.offer(one)
        assert sending.held.wait(30)
        assert not sender.agree(2) and not receiver.agree(2)  # step 1's copy in flight: no new copy step
        sending.release.set()
        assert sender.flush(30) and sender.copied_step == 1
        agreed = sender.agree(3)
        assert agreed and receiver.agree(3)  # every rank finished step 1: a new copy step
        assert sender.settled == receiver.settled == 1 and agreed.settled == 1  # ... and step 1 is settled

        sender.offer(_torn(three, tmp_path / "torn"))  # copy step 3, a byte changed after its record was written
        receiver.offer(three)
        assert sender.flush(30)
        assert sender.copied_step == 1  # not acknowledged as kept
        assert [s.step for s in held.snapshots()] == [1]  # a copy is whole or ignored
        assert sender.agree(4) and receiver.agree(4)  # finished (not whole): the next copy step may start
        assert sender.settled == receiver.settled == 1  # still the newest every rank has whole
    finally:
        sender.close(finished=False)
        receiver.close(finished=False)
    assert not any(t.is_alive() for t in sender._threads + receiver._threads)  # STOP ended the receiver
    copy = held.snapshots()[0]
    assert copy.path.read_bytes()[: one.manifest.files[0].size] == one.path.read_bytes()[: one.manifest.files[0].size]


def test_the_rank_holding_the_copies_never_overwrites_the_settled_one_and_a_step_without_a_snapshot_is_said(tmp_path):
    one, two, three = _three(tmp_path)
    held = MemoryStore(tmp_path / "node1" / "partner-of-rank-00000", identity="nodes-0-1")
    channel, sender, receiver = _pair(Wire(), held)
    try:
        assert sender.agree(1) and receiver.agree(1)
        sender.offer(one)
        receiver.offer(one)
        assert sender.flush(30)
        channel.extra = [(1, 1)]  # a third rank: finished step 1 whole, and it will not get step 2 whole
        assert sender.agree(2) and receiver.agree(2) and receiver.settled == 1
        sender.offer(two)
        receiver.offer(two)
        assert sender.flush(30) and sender.copied_step == 2
        channel.extra = [(2, 1)]  # ... it finished step 2, not whole: 1 stays settled
        assert sender.agree(3) and receiver.agree(3) and receiver.settled == 1
        assert sorted(s.step for s in held.snapshots()) == [1, 2]  # two slots
        sender.offer(three)
        receiver.offer(three)
        assert sender.flush(30)
        # the copy of 3 took the slot of 2 (newer, not settled), not the settled 1's: a node lost now resumes at 1
        assert sorted(s.step for s in held.snapshots()) == [1, 3]

        channel.extra = [(3, 3)]
        assert sender.agree(4) and receiver.agree(4) and receiver.settled == 3
        sender.skip(4)  # copy step 4 has no snapshot on the sending rank (its copy failed, say)
        receiver.skip(4)
        assert sender.flush(30)
    finally:
        sender.close(finished=False)
        receiver.close(finished=False)  # it takes the word for step 4, then the STOP
    channel.extra = [(4, 4)]
    assert receiver.vote() == (4, 3)  # finished step 4, nothing of it whole
    assert sender.agree(5) and receiver.agree(5)  # so the copy steps go on
    assert sorted(s.step for s in held.snapshots()) == [1, 3]


def test_persist_ls_shows_the_partner_copies_a_node_holds_and_gc_never_removes_a_live_receivers(tmp_path):
    import json

    from click.testing import CliRunner

    from persist_core.cli import main

    _, new = _snapshots(tmp_path)
    shm, ckpt = tmp_path / "shm", str(tmp_path / "ckpt")
    run = next(shm.iterdir())
    wire = Wire()
    held = MemoryStore(run / "partner-of-rank-00001", identity=None)  # this node holds rank 1's
    channel, sender, receiver = _pair(wire, held, ranks=(1, 0))
    try:
        assert sender.agree(2) and receiver.agree(2)
        sender.offer(new)
        assert sender.flush(30) and sender.copied_step == 2

        def ls() -> list[dict]:
            out = CliRunner().invoke(main, ["ls", ckpt, "--json", "--memory-dir", str(shm)]).output
            return [r for r in json.loads(out) if r["kind"].startswith("memory")]

        assert ("memory-partner", 2, [1], "live") in [(r["kind"], r["step"], r["ranks"], r["process"]) for r in ls()]
        done = CliRunner().invoke(main, ["gc", ckpt, "--memory", "--memory-dir", str(shm), "--json"])
        assert done.exit_code == 0, done.output
        assert not [p for p in json.loads(done.output)["memory_removed"] if "partner-of-rank" in p]  # it is live
        assert [s.step for s in held.snapshots()] == [2]
    finally:
        sender.close(finished=False)
        receiver.close(finished=False)  # as a killed process leaves them: stopped
    assert [(r["kind"], r["process"]) for r in ls() if r["kind"] == "memory-partner"] == [("memory-partner", "stopped")]
    done = CliRunner().invoke(main, ["gc", ckpt, "--memory", "--memory-dir", str(shm), "--json"])
    assert [p for p in json.loads(done.output)["memory_removed"] if "partner-of-rank-00001" in p]
    assert not held.snapshots()


def test_a_run_that_goes_back_to_an_older_step_starts_the_copy_steps_over_and_drops_the_given_up_branchs_copies(
        tmp_path):
    one, two = _snapshots(tmp_path)
    held = MemoryStore(tmp_path / "node1" / "partner-of-rank-00000", identity="nodes-0-1")
    channel, sender, receiver = _pair(Wire(), held)
    try:
        for snap in (one, two):
            assert sender.agree(snap.step) and receiver.agree(snap.step)
            sender.offer(snap)
            receiver.offer(snap)
            assert sender.flush(30)
        assert sender.settled == 1 and sorted(s.step for s in held.snapshots()) == [1, 2]
        # engine.load(1): the run goes on from step 1 again; its steps 1, 2, ... are not the ones copied before
        agreed = sender.agree(1)
        assert agreed and receiver.agree(1)
        assert held.snapshots() == []  # the given-up branch's copies: a restore must never pull them
        assert sender.settled == receiver.settled == -1 and agreed.settled == -1  # the kept slots go back
        sender.offer(one)
        receiver.offer(one)
        assert sender.flush(30) and sender.agree(2) and receiver.agree(2) and sender.settled == 1
        assert [s.step for s in held.snapshots()] == [1]
    finally:
        sender.close(finished=False)
        receiver.close(finished=False)
