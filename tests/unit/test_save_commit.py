"""The commit protocol (persist_core/save/commit.py) with several ranks in one process: one thread per rank over
in-process fake collectives, real files under tmp_path, no process group. What is committed when every rank
succeeds, that nothing is when one fails, and which ranks share a local_dir."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Callable

import pytest

from persist_core.errors import PersistError
from persist_core.fileio import CHECKSUM_ALGORITHM, OsFileOps
from persist_core.format.manifest import FileEntry, Manifest
from persist_core.layout import checkpoint_dirname, shard_filename
from persist_core.save.commit import Nodes, commit_checkpoint, discover_nodes
from persist_core.tiers.local import read_manifest
from persist_core.format.records import Chunk, TensorRecord

WAIT_S = 10.0


class World:
    """What the ranks of one fake job share: the deposits of each collective call, by call number."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.cond = threading.Condition()
        self.calls: dict[int, tuple[str, list[Any], set[int]]] = {}
        self.broken: str | None = None
        self.log: dict[int, list[str]] = {r: [] for r in range(size)}

    def ranks(self) -> list[FakeCollectives]:
        return [FakeCollectives(self, r) for r in range(self.size)]

    def leave(self, rank: int) -> None:
        """``rank`` died: every collective call still waiting (or made later) raises, as a broken group does."""
        with self.cond:
            self.broken = f"rank {rank} left the group"
            self.cond.notify_all()


class FakeCollectives:
    """The ``Collectives`` protocol for one rank of a :class:`World`: the Nth call of every rank meets the Nth
    call of the others (a rank making another kind of call there fails the test)."""

    def __init__(self, world: World, rank: int) -> None:
        self.world, self._rank, self._n = world, rank, 0

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self.world.size

    def _meet(self, kind: str, obj: Any) -> list[Any]:
        w = self.world
        with w.cond:
            n, self._n = self._n, self._n + 1
            w.log[self._rank].append(kind)
            got, objs, arrived = w.calls.setdefault(n, (kind, [None] * w.size, set()))
            assert got == kind, f"call {n}: rank {self._rank} made {kind}, another rank {got}"
            objs[self._rank] = obj
            arrived.add(self._rank)
            w.cond.notify_all()
            ok = w.cond.wait_for(lambda: len(arrived) == w.size or w.broken is not None, WAIT_S)
            if len(arrived) < w.size:
                raise RuntimeError(w.broken or f"call {n} ({kind}): ranks {sorted(arrived)} only, after {WAIT_S} s")
            assert ok
            return list(objs)

    def broadcast(self, obj: Any) -> Any:
        return self._meet("broadcast", obj)[0]

    def all_gather(self, obj: Any) -> list[Any]:
        return self._meet("all_gather", obj)


def run_ranks(world: World, fn: Callable[[FakeCollectives], Any]) -> list[Any]:
    """``fn(coll)`` on one thread per rank; each rank's return value, or the exception it raised."""
    out: list[Any] = [None] * world.size

    def body(coll: FakeCollectives) -> None:
        try:
            out[coll.rank] = fn(coll)
        except BaseException as e:
            out[coll.rank] = e

    threads = [threading.Thread(target=body, args=(c,), daemon=True, name=f"rank-{c.rank}") for c in world.ranks()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * WAIT_S)
        assert not t.is_alive(), "a rank never returned"
    return out


# ---- what each rank saves: tensor i is written by rank i % world (a state split between the ranks)

TREE_OF = {n: {"dict": [[{"value": f"t{i}"}, {"tensor": i}] for i in range(n)], "ordered": False} for n in range(1, 9)}


def base_for(rank: int, world: int, step: int, n_tensors: int | None = None, *, per_rank: bool = True,
             time: float = 1.0) -> Manifest:
    n = n_tensors or world
    shard = shard_filename(rank)
    records = tuple(TensorRecord(file=shard, entry=f"t{i}", dtype="float32", shape=(2,), stride=(1,), offset=0,
                                 replicated=False) if i % world == rank else None for i in range(n))
    return Manifest(step=step, time=time, world_size=1, tree=TREE_OF[n], tensors=records, objects=(), files=(),
                    per_rank=(((shard, 0, rank + 1),),) if per_rank else ())


def shard_writer(rank: int, calls: list[Path], *, nbytes: int = 64, fail: BaseException | None = None,
                 lie_size: int = 0) -> Callable[[Path], FileEntry]:
    """Writes ``nbytes`` as rank ``rank``'s shard into the directory given (recorded in ``calls``), or raises
    ``fail``; ``lie_size``: the entry says that many bytes more than the file holds."""

    def write(tmp: Path) -> FileEntry:
        calls.append(tmp)
        if fail is not None:
            raise fail
        name = shard_filename(rank)
        (tmp / name).write_bytes(bytes([rank]) * nbytes)
        return FileEntry(name=name, rank=rank, size=nbytes + lie_size, checksum=CHECKSUM_ALGORITHM,
                         chunk_bytes=nbytes + lie_size, chunks=(rank,))

    return write


class Rank:
    """One rank's commit arguments and what the commit did with them."""

    def __init__(self, rank: int, world: int, root: Path, step: int, **writer: Any) -> None:
        self.rank, self.root, self.step = rank, root, step
        self.calls: list[Path] = []
        self.released = 0
        self.write = shard_writer(rank, self.calls, **writer)

    def release(self) -> None:
        self.released += 1


def commit_all(tmp_path: Path, world: int, *, step: int = 7, roots: list[Path] | None = None,
               base: Callable[[int], Manifest] | None = None, writers: dict[int, dict] | None = None,
               signature: Callable[[int], str] = lambda r: "sig", digests: Callable[[int], list] | None = None,
               nodes: bool = False, replace: bool = False, ops: Callable[[int], Any] = lambda r: OsFileOps(),
               ) -> tuple[list[Any], list[Rank], World]:
    roots = roots or [tmp_path] * world
    ranks = [Rank(r, world, roots[r], step, **(writers or {}).get(r, {})) for r in range(world)]
    w = World(world)

    def one(coll: FakeCollectives) -> Manifest:
        me = ranks[coll.rank]
        found = discover_nodes(me.root, coll) if nodes else None
        return commit_checkpoint(me.root, base(coll.rank) if base else base_for(coll.rank, world, step),
                                 signature(coll.rank), digests=digests(coll.rank) if digests else None, coll=coll,
                                 write_shard=me.write, release=me.release, ops=ops(coll.rank), replace=replace,
                                 nodes=found)

    return run_ranks(w, one), ranks, w


def leftovers(root: Path) -> list[str]:
    """Names under ``root`` other than committed checkpoints: temporaries, owner marks, node probes."""
    return sorted(n for n in os.listdir(root) if not n.startswith("step-"))


def assert_not_committed(root: Path, step: int) -> None:
    assert not (root / checkpoint_dirname(step)).exists()
    assert leftovers(root) == []  # the temporary directory and its owner mark are gone


# ---- one directory, every rank succeeds


@pytest.mark.parametrize("world", [1, 3])
def test_every_rank_succeeds_one_manifest_lists_every_rank_and_nothing_temporary_is_left(tmp_path, world):
    out, ranks, w = commit_all(tmp_path, world)
    assert not any(isinstance(o, BaseException) for o in out), out
    committed = read_manifest(tmp_path / checkpoint_dirname(7))  # parses, and every file is there with its size
    assert committed == out[0]
    assert committed.world_size == world and committed.nodes == () and committed.node is None
    assert [f.rank for f in committed.files] == list(range(world))
    assert [t.file for t in committed.tensors] == [shard_filename(i) for i in range(world)]  # merged
    assert committed.per_rank == tuple(((shard_filename(r), 0, r + 1),) for r in range(world))
    for r in range(1, world):  # the others get their own base back
        assert out[r] == base_for(r, world, 7)
    assert {p for rk in ranks for p in rk.calls} == {ranks[0].calls[0]}  # every rank wrote into the one tmp
    assert ranks[0].calls[0].name.startswith(".tmp-step-")
    assert [rk.released for rk in ranks] == [1] * world
    assert leftovers(tmp_path) == []
    if world > 1:
        assert all(w.log[r] == ["broadcast", "all_gather", "broadcast"] for r in range(world))


def test_a_replacing_commit_exchanges_the_step_and_removes_the_old_one(tmp_path):
    commit_all(tmp_path, 2, base=lambda r: base_for(r, 2, 7, time=1.0))
    out, _, _ = commit_all(tmp_path, 2, base=lambda r: base_for(r, 2, 7, time=2.0), replace=True)
    assert not any(isinstance(o, BaseException) for o in out), out
    assert read_manifest(tmp_path / checkpoint_dirname(7)).time == 2.0
    assert leftovers(tmp_path) == []  # the old one, left at the temporary name, is gone


def test_committing_a_step_that_exists_without_replace_fails_everywhere_and_keeps_the_old_one(tmp_path):
    commit_all(tmp_path, 2, base=lambda r: base_for(r, 2, 7, time=1.0))
    out, _, _ = commit_all(tmp_path, 2, base=lambda r: base_for(r, 2, 7, time=2.0))
    assert isinstance(out[0], OSError)  # rank 0's own failure (the rename onto a committed step)
    assert isinstance(out[1], PersistError) and "rank 0: " in str(out[1]) and "not committed" in str(out[1])
    assert read_manifest(tmp_path / checkpoint_dirname(7)).time == 1.0
    assert leftovers(tmp_path) == []


# ---- one directory, one rank fails: nothing is committed, every rank raises


def test_one_rank_failing_to_write_commits_nothing_and_every_rank_raises(tmp_path):
    out, ranks, w = commit_all(tmp_path, 3, writers={1: {"fail": OSError(28, "No space left on device")}})
    assert isinstance(out[1], OSError) and "No space left" in str(out[1])  # its own error, raised as is
    assert any(f"while writing {tmp_path}" in note for note in out[1].__notes__)
    for r in (0, 2):
        assert isinstance(out[r], PersistError), out[r]
        assert "step=7 was not committed" in str(out[r]) and "rank 1: OSError" in str(out[r])
    assert_not_committed(tmp_path, 7)
    assert [rk.released for rk in ranks] == [1, 1, 1]  # the staging buffers are freed on failure too
    assert all(w.log[r] == ["broadcast", "all_gather", "broadcast"] for r in range(3))  # no rank skipped a call


def test_a_failed_step_leaves_the_previous_checkpoint_intact(tmp_path):
    commit_all(tmp_path, 2, step=5)
    out, _, _ = commit_all(tmp_path, 2, step=6, writers={0: {"fail": RuntimeError("boom")}})
    assert isinstance(out[0], RuntimeError) and isinstance(out[1], PersistError) and "rank 0: RuntimeError: boom" \
        in str(out[1])
    assert not (tmp_path / checkpoint_dirname(6)).exists()
    assert read_manifest(tmp_path / checkpoint_dirname(5)).step == 5
    assert leftovers(tmp_path) == []


def test_rank_0_without_a_temporary_directory_fails_every_rank_before_any_writes(tmp_path, monkeypatch):
    import persist_core.save.commit as commit

    def refuse(root, step, name=None):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(commit, "claim_tmp", refuse)
    out, ranks, _ = commit_all(tmp_path, 3)
    assert isinstance(out[0], PermissionError)
    for r in (1, 2):
        assert isinstance(out[r], PersistError) and "could not create a temporary directory" in str(out[r])
    assert all(rk.calls == [] for rk in ranks)  # nobody wrote anywhere
    assert [rk.released for rk in ranks] == [1, 1, 1]
    assert_not_committed(tmp_path, 7)


@pytest.mark.parametrize("case, expected", [
    ("step", "the ranks saved different steps ([7, 8, 7], by rank)"),
    ("signature", "the ranks hold states of different structure"),
    ("digests", "state['t1'] (ranks [2])"),
    ("size", "rank 0 does not see a file another rank wrote"),
    ("unwritten", "no rank wrote tensors [1]"),
])
def test_ranks_that_disagree_commit_nothing_and_every_rank_is_told_why(tmp_path, case, expected):
    kw: dict[str, Any] = {}
    if case == "step":
        kw["base"] = lambda r: base_for(r, 3, 8 if r == 1 else 7)
    elif case == "signature":
        kw["signature"] = lambda r: "other" if r == 2 else "sig"
    elif case == "digests":
        kw["digests"] = lambda r: [None, 5 if r == 2 else 4, None]
    elif case == "size":
        kw["writers"] = {2: {"lie_size": 1}}
    else:  # rank 1's record of tensor 1 never arrives
        kw["base"] = lambda r: Manifest(**{**vars(base_for(r, 3, 7)), "tensors": (None,) * 3}) if r == 1 \
            else base_for(r, 3, 7)
    out, ranks, _ = commit_all(tmp_path, 3, **kw)
    for r in range(3):
        assert isinstance(out[r], PersistError), (r, out[r])
        assert expected in str(out[r])
        # rank 0 raises what it found itself (merging, checking the files); the others, that nothing was committed
        assert "was not committed" in str(out[r]) or (r == 0 and case in ("size", "unwritten"))
    assert_not_committed(tmp_path, 7)
    assert_not_committed(tmp_path, 8)


def test_sharded_tensors_merge_every_ranks_chunks(tmp_path):
    def base(r: int) -> Manifest:
        b = base_for(r, 2, 7, n_tensors=1, per_rank=False)
        rec = TensorRecord(dtype="float32", shape=(4,), placements=["S(0)"], mesh=(2,),
                           chunks=(Chunk(file=shard_filename(r), entry="t0", offsets=(2 * r,), sizes=(2,)),))
        return Manifest(**{**vars(b), "tensors": (rec,)})

    out, _, _ = commit_all(tmp_path, 2, base=base)
    assert not any(isinstance(o, BaseException) for o in out), out
    (rec,) = read_manifest(tmp_path / checkpoint_dirname(7)).tensors
    assert [(c.file, c.offsets) for c in rec.chunks] == [(shard_filename(0), (0,)), (shard_filename(1), (2,))]


def test_a_rank_leaving_the_group_while_writing_commits_nothing(tmp_path):
    world = World(2)
    r0 = Rank(0, 2, tmp_path, 7)

    def one(coll: FakeCollectives) -> Manifest | None:
        if coll.rank == 1:  # takes the temporary name, then dies while writing: never reaches the gather
            assert coll.broadcast(None).startswith(".tmp-step-")
            world.leave(1)
            return None
        return commit_checkpoint(tmp_path, base_for(0, 2, 7), "sig", coll=coll, write_shard=r0.write,
                                 release=r0.release, ops=OsFileOps())

    out = run_ranks(world, one)
    assert isinstance(out[0], PersistError) and "could not gather their reports" in str(out[0])
    assert "rank 1 left the group" in str(out[0])
    assert_not_committed(tmp_path, 7)  # rank 0's temporary directory went with its owner mark
    assert r0.released == 1


# ---- which ranks share a local_dir


def test_ranks_sharing_one_local_dir_are_one_node(tmp_path):
    out = run_ranks(World(3), lambda coll: discover_nodes(tmp_path, coll))
    assert out == [Nodes(groups=((0, 1, 2),), mine=0, rank=r) for r in range(3)]
    assert all(n.shared for n in out) and [n.leader for n in out] == [True, False, False]
    assert os.listdir(tmp_path) == []  # the probes are gone


def test_ranks_with_a_local_dir_each_pair_are_nodes_led_by_their_first_rank(tmp_path):
    roots = [tmp_path / "a", tmp_path / "b", tmp_path / "a", tmp_path / "b"]  # ranks 0, 2 on a; 1, 3 on b
    for r in roots:
        r.mkdir(exist_ok=True)
    out = run_ranks(World(4), lambda coll: discover_nodes(roots[coll.rank], coll))
    assert [n.groups for n in out] == [((0, 2), (1, 3))] * 4
    assert [n.mine for n in out] == [0, 1, 0, 1] and [n.leader for n in out] == [True, True, False, False]
    assert not any(n.shared for n in out)
    assert os.listdir(roots[0]) == [] and os.listdir(roots[1]) == []


def test_a_rank_that_cannot_write_its_probe_fails_discovery_on_every_rank(tmp_path):
    roots = [tmp_path, tmp_path / "missing"]
    out = run_ranks(World(2), lambda coll: discover_nodes(roots[coll.rank], coll))
    for o in out:
        assert isinstance(o, PersistError) and "do not split into nodes" in str(o) and "rank 1 sees" in str(o)
    assert os.listdir(tmp_path) == []


def test_a_failing_probe_write_is_named_in_the_error(tmp_path):
    roots = [tmp_path, tmp_path / "missing"]
    out = run_ranks(World(2), lambda coll: discover_nodes(roots[coll.rank], coll))
    assert all("rank 1 could not write" in str(o) for o in out)


# ---- several nodes, each with its own local_dir


def node_roots(tmp_path: Path) -> list[Path]:
    roots = [tmp_path / "n0", tmp_path / "n0", tmp_path / "n1", tmp_path / "n1"]  # ranks 0, 1 | 2, 3
    for r in roots:
        r.mkdir(exist_ok=True)
    return roots


def test_several_nodes_each_commit_their_own_ranks_files_under_one_merged_manifest(tmp_path):
    roots = node_roots(tmp_path)
    out, ranks, _ = commit_all(tmp_path, 4, roots=roots, nodes=True)
    assert not any(isinstance(o, BaseException) for o in out), out
    for node, root in enumerate(roots[::2]):
        copy = read_manifest(root / checkpoint_dirname(7))  # its own files there, with their sizes
        assert copy.nodes == ((0, 1), (2, 3)) and copy.node == node and copy.world_size == 4
        assert [f.rank for f in copy.files] == [0, 1, 2, 3]
        assert sorted(os.listdir(root / checkpoint_dirname(7))) == sorted(
            ["manifest.json", *(shard_filename(r) for r in (2 * node, 2 * node + 1))])
        assert leftovers(root) == []
    assert [o.node for o in out] == [0, 0, 1, 1]  # every rank gets its node's copy
    assert ranks[0].calls[0].name == ranks[2].calls[0].name  # one temporary name, on both disks


class FsyncFails(OsFileOps):
    def fsync(self, fd: int) -> None:
        raise OSError(5, "Input/output error")


def test_a_node_that_cannot_commit_makes_the_others_take_theirs_back(tmp_path):
    roots = node_roots(tmp_path)
    out, _, _ = commit_all(tmp_path, 4, roots=roots, nodes=True,
                           ops=lambda r: FsyncFails() if r == 2 else OsFileOps())  # node 1's leader's manifest
    for o in out:
        assert isinstance(o, PersistError) and "node 1 (ranks [2, 3]): OSError" in str(o), o
    for root in roots[::2]:
        assert not (root / checkpoint_dirname(7)).exists()  # node 0 had committed its copy: taken back
        assert leftovers(root) == []


def replacing_node_commit(tmp_path: Path, monkeypatch: Any, *, rank_1_first: bool) -> list[Path]:
    """Step 7 committed on both nodes (time 1.0), then re-saved (replace, time 2.0) with node 1's commit failing;
    ``rank_1_first``: node 0's other rank is let go first (rank 0's take-back holds off half a second): it must
    still wait for its leader's take-back before it removes the temporary name."""
    import persist_core.save.commit as commit

    roots = node_roots(tmp_path)
    first, _, _ = commit_all(tmp_path, 4, roots=roots, nodes=True, base=lambda r: base_for(r, 4, 7, time=1.0))
    assert not any(isinstance(o, BaseException) for o in first), first
    rank_1_done, exchanged = threading.Event(), threading.Event()
    real_rmtree, real_exchange = commit.shutil.rmtree, commit.exchange_dirs

    class Shutil:  # the commit's removal of the temporary name after a failed outcome
        @staticmethod
        def rmtree(path: Any, **kw: Any) -> None:
            if threading.current_thread().name == "rank-1" and not rank_1_first:
                assert exchanged.wait(WAIT_S)
            real_rmtree(path, **kw)
            if threading.current_thread().name == "rank-1":
                rank_1_done.set()

    def exchange(new: Path, old: Path) -> None:  # rank 0 taking its copy back (commit_dir's own is not this one)
        if rank_1_first:  # give rank 1 every chance to remove the temporary name first: it must wait for this
            assert not rank_1_done.wait(0.5), "rank 1 removed the temporary name before its leader's take-back"
        try:
            real_exchange(new, old)
        finally:
            exchanged.set()

    monkeypatch.setattr(commit, "shutil", Shutil)
    monkeypatch.setattr(commit, "exchange_dirs", exchange)
    out, _, _ = commit_all(tmp_path, 4, roots=roots, nodes=True, replace=True,
                           base=lambda r: base_for(r, 4, 7, time=2.0),
                           ops=lambda r: FsyncFails() if r == 2 else OsFileOps())
    for o in out:
        assert isinstance(o, PersistError) and "node 1 (ranks [2, 3]): OSError" in str(o), o
    return roots


def test_a_failed_replacing_commit_puts_each_nodes_old_copy_back(tmp_path, monkeypatch):
    roots = replacing_node_commit(tmp_path, monkeypatch, rank_1_first=False)
    for root in roots[::2]:
        assert read_manifest(root / checkpoint_dirname(7)).time == 1.0
        assert leftovers(root) == []


def test_a_failed_replacing_commit_keeps_the_old_copy_whoever_cleans_up_first(tmp_path, monkeypatch):
    roots = replacing_node_commit(tmp_path, monkeypatch, rank_1_first=True)
    assert read_manifest(roots[0] / checkpoint_dirname(7)).time == 1.0


def test_a_commit_reported_failed_leaves_no_step_behind(tmp_path, monkeypatch):
    import persist_core.fileio as fileio

    real = fileio.fsync_dir

    def failing(path: Path) -> None:
        if Path(path) == tmp_path:
            raise OSError(5, "Input/output error")
        real(path)

    monkeypatch.setattr(fileio, "fsync_dir", failing)
    out, _, _ = commit_all(tmp_path, 2)
    assert all(isinstance(o, BaseException) for o in out)
    assert not (tmp_path / checkpoint_dirname(7)).exists()
